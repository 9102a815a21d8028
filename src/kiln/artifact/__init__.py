"""The torch-free world: the artifact, its manifest, where it is stored, and restoring it.

Everything under this package runs in slim init containers and Docker build stages that have
no torch: ``kiln restore``, ``kiln inspect`` and ``kiln push`` import nothing else. A module here
never imports torch or :mod:`kiln.compiler`, not even lazily (``tests/test_torch_free.py``
holds the line).
"""
