"""TEMPORARY, test-only stand-in for the installed `deepspeed` compat distribution (`slipstream compat install`).

tests/compat_hf puts this directory (with its dist-info) on sys.path when no `deepspeed` distribution is
installed, so the tests run without changing the virtual environment; it is never installed and never imported
by the package. It is the distribution's one file (compat/deepspeed_dist.activate); nothing is filled in here,
so a DeepSpeed name Slipstream lacks fails the tests as it would fail a user.
"""

from slipstream.compat.deepspeed_dist import activate as _activate

_activate(globals())
