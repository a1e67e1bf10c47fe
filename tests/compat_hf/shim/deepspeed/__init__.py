"""TEMPORARY, test-only stand-in for the installed `deepspeed` compat distribution (`slipstream compat install`).

tests/compat_hf puts this directory (with its dist-info) on sys.path when no `deepspeed` distribution is
installed, so the tests run without changing the virtual environment; it is never installed and never imported
by the package. It is the distribution's one file (compat/deepspeed_dist.activate). The names Slipstream still
lacks are filled by tests/compat_hf/gaps.py, whichever of the two gives `import deepspeed`.
"""

from slipstream.compat.deepspeed_dist import activate as _activate

_activate(globals())
