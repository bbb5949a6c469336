"""pagedserve's kernels: every op behind one backend switch (`kernels/dispatch.py` says how).

The checkout keeps this folder at its root under the design card's name, `kernels`, which is
also the name of Hugging Face's `kernels` package (transformers imports it, and so
sentence-transformers does through transformers). pagedserve imports this folder only as
`pagedserve.kernels`. Python started in the checkout's root (a user's script beside the README,
`python -c`) puts the root first on sys.path, and an `import kernels` there finds this folder:
then the name is handed to the installed package, as if the folder were not there.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    _root = Path(__file__).resolve().parents[1]
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if Path(p or ".").resolve() != _root]
    )
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' (the checkout's kernels/ folder is pagedserve.kernels)",
            name="kernels",
        )
    _installed = importlib.util.module_from_spec(_spec)
    # The import statement returns what sys.modules holds once this file has run: the package.
    sys.modules["kernels"] = _installed
    _spec.loader.exec_module(_installed)
else:
    from pagedserve.kernels.dispatch import *  # noqa: F403
    from pagedserve.kernels.dispatch import __all__  # noqa: F401
