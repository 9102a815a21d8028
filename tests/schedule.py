"""The order the suite runs in under pytest-xdist: the longest tests first, split evenly.

``--dist worksteal`` hands worker K the K-th of N equal-count slices of the collection, in order,
and an idle worker later steals the tail of the busiest one's queue. With the slow tests simply
sorted first, worker 0's slice held every real bake while the others ran the quick tests and
then stole, so a minutes-long bake could start last and end the run alone. Here the slow tests
are dealt to the slices longest first, each to the slice with the least work so far (LPT), the
quick tests fill the slices to equal counts in file order, and each slice runs its longest test
first: the tail that gets stolen is the quick tests. The bakes slow tests share are made once per
run whatever the order (tests/conftest.py ``bake_once``, session-scoped fixtures).

The seconds are a measured `--durations` run on the 2-core CI machine (December 2026), rounded;
a slow test not listed counts as :data:`DEFAULT_SLOW_S`. A stale number only costs balance.
"""

from __future__ import annotations

import os

import pytest

DEFAULT_SLOW_S = 20.0
DEFAULT_FAST_S = 0.3

# Test function name (parameters aside) -> seconds it takes, setup included.
SECONDS = {
    "test_bench_modes_and_ratios": 107,
    "test_the_quick_start_runs_as_written": 100,
    "test_graph_break_model_serves_its_saved_frames_without_tracing": 90,
    "test_three_shards_merge_into_what_one_process_serves": 70,
    "test_two_rank_shards_bake_merge_restore_and_verify": 73,
    "test_a_bake_on_an_image_without_bytecode_ships_it_and_verify_serves_it": 72,
    "test_bench_precompile_spec_compares_with_plain_compile_caches": 69,
    "test_precompiled_forwards_skip_dynamo_and_fall_back_off_grid": 69,
    "test_random_shapes_are_served_padded_with_0_compiles_and_eager_outputs": 45,
    "test_two_rank_bake_restore_verify_hits_on_both_ranks": 66,
    "test_bake_says_when_a_fresh_process_still_compiles": 58,
    "test_data_dependent_break_is_warned_about_and_verify_names_it": 63,
    "test_a_bake_inside_a_users_torchrun_restores_and_hits_on_both_ranks": 58,
    "test_automatic_dynamic_is_order_independent": 58,
    "test_bench_runs_every_rank": 57,
    "test_shards_merge_into_one_set_of_packages": 56,
    "test_bench_serves_the_aot_route_beside_the_compile_route": 52,
    "test_strict_bake_whose_proof_keeps_compiling_is_exit_6_without_artifact": 51,
    "test_two_ranks_serve_their_packages_with_collectives": 50,
    "test_verify_fails_with_exit_6_on_a_cold_cache": 44,
    "test_autotuning_spec_round_trip": 41,
    "test_bake_ships_extracted_packages_without_weights": 35,
    "test_verify_with_another_spec_names_keys_and_off_grid_buckets": 27,
    "test_two_bakes_of_one_spec_reproduce_each_other": 27,
    "test_check_and_activate_word_an_incompatibility_alike": 31,
    "test_check_of_a_moved_folder_is_exit_5_naming_the_cache_location": 30,
    "test_bench_eager_and_aoti_alone_bakes_once": 30,
    "test_bake_on_a_follower_rank_returns_what_it_did_not_none": 28,
    "test_roundtrip_zero_compiles_in_any_order": 28,
    "test_bake_sign_key_then_restore_verified": 28,
    "test_one_ranged_program_with_embedded_weights": 27,
    "test_a_finished_bake_leaves_nothing_in_tmpdir": 27,
    "test_failed_bake_leaves_no_artifact": 27,
    "test_piped_bake_says_which_bucket_starts_and_that_it_is_alive": 26,
    "test_warmup_calls_draw_fresh_inputs_and_plain_breaks_are_listed": 25,
    "test_restore_target_builds_and_runs_torch_free": 25,
    "test_verify_names_a_kernel_the_folder_lost_and_leaves_the_folder_as_found": 21,
    "test_off_grid_policies": 22,
}


def seconds(item: pytest.Item) -> float:
    """What ``item`` is expected to take on the CI machine (0 for a test that will be skipped)."""
    if item.get_closest_marker("skip") is not None:
        return 0.0
    name = getattr(item, "originalname", item.name)
    if name in SECONDS:
        return float(SECONDS[name])
    return DEFAULT_SLOW_S if "slow" in item.keywords else DEFAULT_FAST_S


def order(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` as ``workers`` equal-count slices (what worksteal hands out): the slow tests
    dealt longest first to the slice with the least work, then the quick ones in file order
    (a module's quick tests stay together, so its module-scoped fixtures are made once)."""
    slow = [item for item in items if "slow" in item.keywords]
    fast = [item for item in items if "slow" not in item.keywords]
    if workers < 2:
        return slow + fast
    sizes, left = [], len(items)
    for k in range(workers):  # as worksteal cuts them: each idle worker a share of what is left
        sizes.append(left // (workers - k))
        left -= sizes[-1]
    slices: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for item in sorted(slow, key=seconds, reverse=True):  # stable: file order among equals
        k = min((k for k in range(workers) if len(slices[k]) < sizes[k]), key=lambda k: load[k])
        slices[k].append(item)
        load[k] += seconds(item)
    rest = iter(fast)
    for k in range(workers):
        slices[k] += [next(rest) for _ in range(sizes[k] - len(slices[k]))]
    return [item for part in slices for item in part]


def worker_count() -> int:
    """How many xdist workers share the run (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
