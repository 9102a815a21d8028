"""The torch world: compiling a spec's grid and proving what a restored cache does.

Bake, the grid worker, verify, bench, check and ``activate()`` run where the model runs, with
torch installed. They import torch inside the functions that need it, so importing this package
stays cheap, but nothing in :mod:`kiln.artifact` may import from here.
"""
