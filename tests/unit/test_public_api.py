"""The public API against its committed snapshot (docs/support.md): removing a public name or changing a
signature fails here until it is made deliberately (snapshot updated, CHANGELOG.md entry written)."""

from __future__ import annotations

import json

from slipstream.public_api import PUBLIC_API, SNAPSHOT_PATH, snapshot

UPDATE = "if the change is deliberate, run `python -m slipstream.public_api --write` and add a CHANGELOG.md entry"


def _flatten(tree: dict[str, dict[str, object]]) -> dict[str, str]:
    flat: dict[str, str] = {}
    for module, names in tree.items():
        for name, description in names.items():
            if isinstance(description, dict) and description.get("kind") == "class":
                flat[f"{module}.{name}()"] = str(description["init"])
                for method, signature in dict(description["methods"]).items():
                    flat[f"{module}.{name}.{method}"] = str(signature)
            else:
                flat[f"{module}.{name}"] = json.dumps(description, sort_keys=True)
    return flat


def test_the_public_api_matches_its_snapshot() -> None:
    committed = _flatten(json.loads(SNAPSHOT_PATH.read_text()))
    current = _flatten(snapshot())
    removed = sorted(set(committed) - set(current))
    added = sorted(set(current) - set(committed))
    changed = sorted(
        f"{key}: {committed[key]} -> {current[key]}"
        for key in set(committed) & set(current)
        if committed[key] != current[key]
    )
    assert not removed, f"public names removed: {removed}; deprecate first (slipstream/utils/deprecation.py); {UPDATE}"
    assert not changed, f"public signatures changed: {changed}; {UPDATE}"
    assert not added, f"new public names: {added}; {UPDATE}"


def test_the_comparison_sees_a_removed_method_and_a_changed_signature() -> None:
    tree = {"m": {"C": {"kind": "class", "init": "(self)", "methods": {"step": "(self)", "save": "(self, d)"}}}}
    flat = _flatten(tree)
    assert flat == {"m.C()": "(self)", "m.C.step": "(self)", "m.C.save": "(self, d)"}
    tree["m"]["C"]["methods"] = {"step": "(self, x)"}
    assert _flatten(tree) != flat and "m.C.save" not in _flatten(tree)


def test_every_listed_module_is_importable_and_every_name_present() -> None:
    tree = snapshot()
    assert set(tree) == set(PUBLIC_API)
    assert all(set(tree[module]) == set(names) for module, names in PUBLIC_API.items())
