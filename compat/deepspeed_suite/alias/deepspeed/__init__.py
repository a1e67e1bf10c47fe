"""A temporary `deepspeed` import name for Slipstream, used only by the acceptance suite's runner (put on
PYTHONPATH by run.py) until the compat distribution that provides the name lands.

`import deepspeed` gives the `slipstream` module itself, and `import deepspeed.X.Y` gives `slipstream.X.Y`
(one module object under both names, so state is shared); a path Slipstream lacks fails as it would for a user.
"""

import importlib
import importlib.abc
import importlib.util
import sys

import slipstream

_PREFIX = "deepspeed."


class _Loader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target
        self.target_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.target_spec  # the import system stamped the alias spec on the shared module


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(_PREFIX):
            return None
        target_name = "slipstream." + fullname[len(_PREFIX) :]
        try:
            found = importlib.util.find_spec(target_name)
        except (ImportError, AttributeError, ValueError):
            return None
        if found is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(target_name))


sys.meta_path.insert(0, _Finder())
sys.modules["deepspeed"] = slipstream
