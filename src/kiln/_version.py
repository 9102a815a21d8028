"""kiln's version, in one place: the package, the manifest writer and the build all read it here
(a module of its own, so the manifest can record it without importing the whole package)."""

__version__ = "0.1.0"
