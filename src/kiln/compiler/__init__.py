"""The torch world: compiling a spec's grid and proving what a restored cache does.

Bake, the grid worker, verify, bench, check and ``activate()`` run where the model runs, with
torch installed. They import torch inside the functions that need it, so importing this package
stays cheap, but nothing in :mod:`kiln.artifact` may import from here.
"""

import warnings

# What torch's CPU wheel says at import when numpy is absent. kiln never hands torch a numpy
# array, so it is noise on every command that imports torch.
NUMPY_WARNING = "Failed to initialize NumPy"


def ignore_numpy_warning() -> None:
    """Hide torch's "Failed to initialize NumPy" UserWarning in this process, and only it.

    Called before torch is imported by kiln's own processes (the CLI, the grid worker, the
    example server): the warning is raised once, from C++, during ``import torch``. Filtered by
    message and category, so every other warning torch or the model raises still shows. Here,
    not beside the launch code, so that the CLI sets it without importing what launches.
    """
    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
