"""The deprecation helper: old names keep working, and each use names the replacement and the removal."""

from __future__ import annotations

import warnings

import pytest

from slipstream.utils.deprecation import Deprecated, SlipstreamDeprecationWarning, deprecated_names, warn_deprecated


def test_warning_names_the_replacement_and_the_earliest_removal() -> None:
    with pytest.warns(
        SlipstreamDeprecationWarning,
        match=r"old_thing is deprecated since Slipstream 0\.2\.1 and may be "
        r"removed in 0\.4; use new_thing instead",
    ):
        warn_deprecated("old_thing", "new_thing", since="0.2.1")


def test_an_old_module_attribute_still_resolves_to_its_replacement() -> None:
    getattr_ = deprecated_names("slipstream.example", {"OldJoin": Deprecated("os.path:join", since="0.1")})
    with pytest.warns(SlipstreamDeprecationWarning, match=r"slipstream\.example\.OldJoin .* use os\.path\.join"):
        join = getattr_("OldJoin")
    import os.path

    assert join is os.path.join
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        getattr_("Missing")


def test_deprecation_warnings_are_deprecation_warnings() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_deprecated("a", "b", since="0.1")
    assert [issubclass(w.category, DeprecationWarning) for w in seen] == [True]
