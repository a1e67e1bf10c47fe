"""DeepSpeed's own unit tests as Slipstream's acceptance suite: run them against real DeepSpeed and
against Slipstream imported under the name `deepspeed`, and print, per folder, how many tests each passes.

    python compat/deepspeed_suite/run.py                 # both sides (`make compat`)
    python compat/deepspeed_suite/run.py --side slipstream   # Slipstream only, against the committed denominator
    python compat/deepspeed_suite/run.py --table         # the table from the committed results, no run

Where things are (each from an argument, else the environment, else a default relative to this repository):
    --deepspeed-repo  DeepSpeed's git repository ($DEEPSPEED_REPO; default: ../DeepSpeed next to this repository)
    --ref             the tag whose tests run ($DEEPSPEED_REF; default v0.19.8)
    --workdir         extracted tests, reports and logs ($SLIPSTREAM_SUITE_WORKDIR; default: the system temporary
                      directory's slipstream-deepspeed-suite)
    --peer-python     the Python with real DeepSpeed (default: .bench-venv/bin/python here)
    --python          the Python with Slipstream (default: .venv/bin/python here)
Paths in the recorded failure messages are written relative to these places (`<workdir>`, `<slipstream_src>`,
`<repo>`, `<tmp>`), so the committed results hold no machine's directories.

The denominator is every test real DeepSpeed passes on this machine, less the exclusions (tests that assert on
DeepSpeed's private internals, each with its reason in exclusions.txt). DeepSpeed's tests are third-party files:
they are extracted from a DeepSpeed git repository into a directory outside this repository and never committed.
What is committed: this runner, the plugin, the list of test ids (test_ids.txt), the exclusions and the results
(results.json: test id -> outcome, with the failure's last error line for Slipstream).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results.json"
TEST_IDS = HERE / "test_ids.txt"
EXCLUSIONS = HERE / "exclusions.txt"

# (folder label, the paths under tests/ that make it up). A test belongs to the first folder whose path prefixes
# its id. The labels are the acceptance table's.
FOLDERS: list[tuple[str, list[str]]] = [
    ("runtime/zero", ["unit/runtime/zero"]),
    # DeepSpeed's LAMB tests are classes in other folders' files: a node id as a path takes only them.
    (
        "lamb",
        [
            "unit/runtime/half_precision/test_fp16.py::TestLambFP32GradClip",
            "unit/runtime/half_precision/test_fp16.py::TestLambFP16",
            "unit/runtime/half_precision/test_fp16.py::TestFP16OptimizerForMoE::test_lamb_gradnorm",
            "unit/runtime/half_precision/test_dynamic_loss_scale.py::TestUnfused",
            "unit/checkpoint/test_other_optimizer.py::TestOtherOptimizerCheckpoint::test_checkpoint_unfused_optimizer",
            "unit/elasticity/test_elastic.py::TestNonElasticBatchParams",
            "unit/elasticity/test_elastic.py::TestNonElasticBatchParamsWithOverride",
            "unit/elasticity/test_elastic.py::TestElasticConfigChanged",
        ],
    ),
    ("runtime/half_precision/onebit", ["unit/runtime/half_precision/onebit"]),
    ("runtime/half_precision", ["unit/runtime/half_precision"]),
    ("checkpoint", ["unit/checkpoint"]),
    ("runtime/test_ds_config*", ["unit/runtime/test_ds_config_dict.py", "unit/runtime/test_ds_config_model.py"]),
    ("runtime/test_ds_initialize", ["unit/runtime/test_ds_initialize.py"]),
    ("lr_schedules", ["unit/runtime/test_lr_schedulers.py"]),
    ("launcher", ["unit/launcher"]),
    ("ops/adam", ["unit/ops/adam"]),
    ("ops/muon", ["unit/ops/muon"]),
    ("utils", ["unit/utils"]),
    ("compression", ["unit/compression"]),
    # The data-efficiency library: the curriculum sampler and the legacy curriculum scheduler, progressive layer
    # drop, the engine's data loader, and block-sparse attention.
    ("data_efficiency", ["unit/runtime/test_data_efficiency.py"]),
    ("progressive_layer_drop", ["unit/runtime/test_pld.py"]),
    ("runtime/test_data", ["unit/runtime/test_data.py"]),
    ("ops/sparse_attention", ["unit/ops/sparse_attention"]),
    ("eigenvalue", ["unit/runtime/test_engine_eigenvalue.py"]),
    ("runtime/sparse_tensor", ["unit/runtime/sparse_tensor"]),
]

DEFAULT_REPO = str(ROOT.parent / "DeepSpeed")  # a clone of DeepSpeed's git repository next to this one
DEFAULT_REF = "v0.19.8"  # falls back to HEAD when the repository has no such tag (said in the output)


# ----------------------------------------------------------------------------------------------- pure parts
def _separators(path: str) -> tuple[str, ...]:
    """What may follow a FOLDERS path in a test id under it: a folder's "/", a module's "::", a node id's
    "::" (a method of a class) or "[" (a parametrization of a function)."""
    if "::" in path:
        return ("::", "[")
    return ("::",) if path.endswith(".py") else ("/",)


def folder_of(test_id: str) -> str | None:
    """The folder label a test id belongs to (None: outside the suite's folders)."""
    for label, paths in FOLDERS:
        for path in paths:
            if test_id == path or any(test_id.startswith(path.rstrip("/") + sep) for sep in _separators(path)):
                return label
    return None


def pytest_targets(paths: list[str]) -> tuple[list[str], list[str]]:
    """The FOLDERS paths of a run -> (the files and folders pytest is given, the prefixes its tests are selected
    by). pytest is given modules, not node ids: a node id in a module that skips itself at import is an error
    for pytest ("found no collectors"); the plugin selects the tests (`--suite-select`), only where a path names
    a node id (else the selection is empty: every collected test runs)."""
    targets = list(dict.fromkeys(path.split("::", 1)[0] for path in paths))
    return targets, (list(paths) if any("::" in path for path in paths) else [])


def read_jsonl(lines: Iterable[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """The plugin's report lines -> ({test id: {"outcome", "message", "seconds"}}, {module id: collection error}).
    A test reported twice keeps its last report."""
    tests: dict[str, dict] = {}
    collect_errors: dict[str, str] = {}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        record = json.loads(line)
        if record["outcome"] == "collect-error":
            collect_errors[record["id"]] = record.get("message", "")
        else:
            tests[record["id"]] = {k: record.get(k) for k in ("outcome", "message", "seconds")}
    return tests, collect_errors


def read_exclusions(lines: Iterable[str]) -> dict[str, str]:
    """exclusions.txt: `<test id or id prefix>  # <reason>` per line; '#' lines are comments. A line without a
    reason is an error: every exclusion says why."""
    exclusions: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        test_id, sep, reason = line.partition(" # ")
        if not sep or not reason.strip():
            raise ValueError(f"exclusions.txt line {number}: {line!r} has no reason; write `<id>  # <reason>`")
        exclusions[test_id.strip()] = reason.strip()
    return exclusions


def is_excluded(test_id: str, exclusions: Mapping[str, str]) -> bool:
    return any(test_id == key or test_id.startswith(key) for key in exclusions)


def outcome_for(test_id: str, tests: Mapping[str, dict], collect_errors: Mapping[str, str]) -> dict:
    """A test's outcome on a side; a test the side never ran is an error, with its module's collection error
    when there was one."""
    if test_id in tests:
        return dict(tests[test_id])
    module = test_id.split("::", 1)[0]
    if module in collect_errors:
        return {"outcome": "error", "message": f"collection: {collect_errors[module]}", "seconds": 0}
    return {"outcome": "error", "message": "not run (not collected)", "seconds": 0}


def table_rows(
    deepspeed: Mapping[str, str], slipstream: Mapping[str, str], exclusions: Mapping[str, str]
) -> list[tuple[str, int, int, int, float]]:
    """Per folder: (label, DeepSpeed passes, Slipstream passes of those, excluded, % of the denominator),
    where the denominator is DeepSpeed's passes less the excluded ones; a last row sums them."""
    rows = []
    total = [0, 0, 0]
    for label, _ in FOLDERS:
        ds_pass = [t for t, o in deepspeed.items() if o == "passed" and folder_of(t) == label]
        excluded = [t for t in ds_pass if is_excluded(t, exclusions)]
        counted = [t for t in ds_pass if not is_excluded(t, exclusions)]
        ss_pass = [t for t in counted if slipstream.get(t) == "passed"]
        denominator = len(counted)
        percent = 100.0 * len(ss_pass) / denominator if denominator else 100.0
        rows.append((label, len(ds_pass), len(ss_pass), len(excluded), percent))
        total = [total[0] + len(ds_pass), total[1] + len(ss_pass), total[2] + len(excluded)]
    denominator = total[0] - total[2]
    rows.append(("total", total[0], total[1], total[2], 100.0 * total[1] / denominator if denominator else 100.0))
    return rows


def format_table(rows: list[tuple[str, int, int, int, float]]) -> str:
    lines = [
        f"{'folder':<28} {'DeepSpeed passes':>16} {'Slipstream passes':>17} {'excluded':>8} {'%':>6}",
        "-" * 79,
    ]
    for label, ds, ss, excluded, percent in rows:
        share = f"{percent:>5.1f}%" if ds > excluded else "     -"  # "-": DeepSpeed passes none of it here
        lines.append(f"{label:<28} {ds:>16} {ss:>17} {excluded:>8} {share}")
    return "\n".join(lines)


def cause_of(message: str) -> str:
    """A failure message reduced to its cause, so failures group: paths, addresses and numbers dropped."""
    import re

    text = message.removeprefix("collection: ")
    text = re.sub(r"\(/[^)]*\)", "", text)  # "(/path/to/module.py)"
    text = re.sub(r"/\S+", "<path>", text)
    text = re.sub(r"0x[0-9a-f]+", "<addr>", text)
    text = re.sub(r"\b\d+(\.\d+)?\b", "<n>", text)
    return " ".join(text.split())[:160] or "(no message)"


def causes_markdown(slipstream: Mapping[str, str], denominator: Iterable[str]) -> str:
    """Markdown: each cause of a Slipstream failure among the denominator's tests, with the count and the test
    modules it hits (docs/deepspeed-compat.md, "Acceptance suite")."""
    groups: dict[str, list[str]] = {}
    for test_id in denominator:
        value = slipstream.get(test_id, "error: not run")
        if value == "passed":
            continue
        outcome, _, message = value.partition(": ")
        groups.setdefault(cause_of(message) if message else outcome, []).append(test_id)
    lines = ["| cause (the error Slipstream raised) | tests | modules |", "|---|---|---|"]
    for cause, ids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        modules = sorted({t.split("::", 1)[0].removeprefix("unit/") for t in ids})
        cause_text = cause.replace("|", "\\|")
        lines.append(f"| `{cause_text}` | {len(ids)} | {', '.join(modules)} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- running
def extract(repo: str, ref: str, dest: Path) -> str:
    """DeepSpeed's tests/unit (with tests/conftest.py and pytest.ini) at `ref` into dest/tests; returns the
    commit used. dest is outside this repository: the files are third-party and never committed."""
    if not Path(repo).exists():
        raise SystemExit(
            f"DeepSpeed's repository is not at {repo}: fetch DeepSpeed's git repository and pass its path with"
            " --deepspeed-repo (or DEEPSPEED_REPO); the PyPI sdist has no tests."
        )
    resolved = subprocess.run(
        ["git", "-C", repo, "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"], capture_output=True, text=True
    )
    if resolved.returncode != 0:
        print(f"note: {repo} has no {ref}; using HEAD's tests", flush=True)
        ref = "HEAD"
    commit = subprocess.run(
        ["git", "-C", repo, "rev-parse", f"{ref}^{{commit}}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    marker = dest / "tests" / ".commit"
    if marker.exists() and marker.read_text().strip() == commit:
        return commit
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(dest / "tests")], check=True)
    archive = subprocess.Popen(
        ["git", "-C", repo, "archive", commit, "tests/conftest.py", "tests/pytest.ini", "tests/unit"],
        stdout=subprocess.PIPE,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive of {commit} failed")
    marker.write_text(commit + "\n")
    return commit


def unpack_compat_wheel(python: str, dest: Path) -> str:
    """The `deepspeed` compat distribution (`slipstream compat wheel`) unpacked into dest, which then goes on
    PYTHONPATH: `import deepspeed` and `importlib.metadata.version("deepspeed")` answer with Slipstream there,
    and nothing is installed into the development environment."""
    import zipfile

    subprocess.run(["rm", "-rf", str(dest)], check=True)
    (dest / "wheel").mkdir(parents=True)
    subprocess.run(
        [python, "-m", "slipstream.cli.main", "compat", "wheel", str(dest / "wheel")],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (wheel,) = (dest / "wheel").glob("deepspeed-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(dest / "site")
    return str(dest / "site")


WARM_UP = {
    # What each side compiles at first use; built once, with no time limit, before the timed tests: a build
    # cut by a test's timeout leaves torch's build lock behind and every later test waits on it.
    "deepspeed": "import torch\n"
    "from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam\n"
    "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])\n"
    "FusedAdam([torch.nn.Parameter(torch.zeros(1))])\n",
    "slipstream": "import torch\n"
    "from slipstream.ops.adam import DeepSpeedCPUAdam\n"
    "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])\n",
}


def warm_up(side: str, python: str, env: Mapping[str, str]) -> None:
    """Build a side's JIT ops (WARM_UP) before its timed run, and say how long that took."""
    started = time.monotonic()
    done = subprocess.run(
        ["nice", "-n", "5", python, "-c", WARM_UP[side]], env=dict(env), capture_output=True, text=True
    )
    state = "ready" if done.returncode == 0 else f"not built ({done.stderr.strip().splitlines()[-1:]})"
    print(f"{side}: JIT ops {state} in {time.monotonic() - started:.0f} s", flush=True)


def side_env(side: str, alias_dir: str | None) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(HERE)] + ([alias_dir] if alias_dir else [])
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        DS_ACCELERATOR="cpu",  # DeepSpeed's accelerator choice (Slipstream reads the same variable)
        LOCAL_SIZE="2",  # the CPU accelerators' device count: 2-rank tests run, 4- and 8-rank tests skip
        CUDA_VISIBLE_DEVICES="",
        DS_DISABLE_REUSE_DIST_ENV="1",  # tests run forked: a reused pool would not outlive its test anyway
        OMP_NUM_THREADS="1",
        HF_HOME=str(Path(tempfile.gettempdir()) / "slipstream-suite-hf"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("PYTEST_ADDOPTS", None)
    return env


HUNG_EXIT = 70  # suite_plugin's exit status after it killed a hung test


def run_side(
    python: str,
    tests_dir: Path,
    paths: list[str],
    report: Path,
    env: Mapping[str, str],
    *,
    select: list[str],
    timeout: float,
    max_params: int,
    ids_file: Path | None,
    log: Path,
) -> float:
    """Run pytest for one side (resuming after each hung test); returns its wall time in seconds."""
    if report.exists():
        report.unlink()
    skip_file = report.with_suffix(".done")
    cmd = [
        "nice",
        "-n",
        "5",
        python,
        "-m",
        "pytest",
        "-p",
        "suite_plugin",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "--continue-on-collection-errors",
        "-rN",
        "--no-header",
        f"--timeout={timeout:g}",
        "--timeout-method=signal",
        f"--suite-hard-timeout={timeout + 60:g}",
        f"--suite-report={report}",
        f"--suite-skip-ids={skip_file}",
        "--suite-preload=torch,deepspeed",
    ]
    cmd += [f"--suite-ids={ids_file}"] if ids_file else [f"--suite-max-params={max_params}"]
    if select:
        select_file = report.with_suffix(".select")
        select_file.write_text("".join(p + "\n" for p in select))
        cmd += [f"--suite-select={select_file}"]
    cmd += paths
    env = dict(env, DS_UNITTEST_TIMEOUT=str(int(timeout + 120)))  # DeepSpeed's own hang exit comes last
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        while True:
            done = read_jsonl(report.read_text().splitlines())[0] if report.exists() else {}
            skip_file.write_text("".join(t + "\n" for t in done))
            proc = subprocess.Popen(
                cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait()
            finally:
                try:
                    os.killpg(proc.pid, 9)  # whatever the run left behind, in its own process group only
                except ProcessLookupError:
                    pass
            if code != HUNG_EXIT:
                break
            out.write("\n[run.py] a test hung; resuming after it\n")
            out.flush()
    return time.monotonic() - started


def load_results(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save_results(results: dict, path: Path = RESULTS) -> None:
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def portable(message: str, places: Mapping[str, str]) -> str:
    """`message` with each directory of `places` (placeholder -> directory, longest first) written as its
    placeholder, so a committed result names no machine's paths."""
    for name, directory in sorted(places.items(), key=lambda item: -len(item[1])):
        if directory:
            message = message.replace(directory.rstrip(os.sep), name)
    return message


def summarise(side: dict[str, dict], places: Mapping[str, str] | None = None) -> dict[str, str]:
    """{id: "passed" | "skipped: why" | "failed: last error line" ...} for the committed results."""
    out = {}
    for test_id, record in sorted(side.items()):
        message = portable((record.get("message") or "").replace("\n", " "), places or {})
        out[test_id] = (
            record["outcome"] if record["outcome"] == "passed" or not message else (f"{record['outcome']}: {message}")
        )
    return out


def beyond_results(
    results: Mapping[str, dict],
    tests: Mapping[str, dict],
    collect_errors: Mapping[str, str],
    wanted: list[str],
    chosen: list[str],
    places: Mapping[str, str],
) -> dict[str, str]:
    """`--beyond`: the Slipstream outcomes of the chosen folders' tests outside the denominator (DeepSpeed skipped
    them here, failed them or could not import their module), over the earlier ones of the other folders. Never
    counted in the table."""
    counted = set(wanted)
    extra = {t: dict(r) for t, r in tests.items() if t not in counted}
    extra.update({module: outcome_for(module, tests, collect_errors) for module in collect_errors})
    previous = {t: o for t, o in results.get("slipstream_beyond", {}).items() if folder_of(t) not in chosen}
    return {**previous, **summarise(extra, places)}


def outcomes(summary: Mapping[str, str]) -> dict[str, str]:
    return {test_id: value.split(":", 1)[0] for test_id, value in summary.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["both", "deepspeed", "slipstream"], default="both")
    parser.add_argument("--table", action="store_true", help="print the table of the committed results and stop")
    parser.add_argument(
        "--causes", action="store_true", help="print the Slipstream failures grouped by cause (markdown)"
    )
    parser.add_argument("--deepspeed-repo", default=os.environ.get("DEEPSPEED_REPO", DEFAULT_REPO))
    parser.add_argument("--ref", default=os.environ.get("DEEPSPEED_REF", DEFAULT_REF))
    parser.add_argument(
        "--workdir",
        default=os.environ.get(
            "SLIPSTREAM_SUITE_WORKDIR", str(Path(tempfile.gettempdir()) / "slipstream-deepspeed-suite")
        ),
    )
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument(
        "--alias",
        default=os.environ.get("SLIPSTREAM_DEEPSPEED_ALIAS"),
        help="directory on PYTHONPATH that makes `import deepspeed` give Slipstream (default: the "
        "compat distribution's wheel, unpacked into the work directory)",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per test")
    parser.add_argument("--max-params", type=int, default=1, help="parametrizations kept per test function")
    parser.add_argument("--folders", default="", help="comma-separated folder labels (default: all)")
    parser.add_argument(
        "--beyond",
        action="store_true",
        help="Slipstream side: run every test of the chosen folders (--max-params), not only the denominator; "
        "the others are recorded apart (results.json `slipstream_beyond`), outside the table",
    )
    parser.add_argument(
        "--slipstream-src",
        default="",
        help="a Slipstream source tree to test instead of the "
        "installed one (put first on PYTHONPATH), e.g. a merge candidate",
    )
    parser.add_argument("--results", default=str(RESULTS), help="the results file (default: the committed one)")
    args = parser.parse_args(argv)

    results_path = Path(args.results)
    results = load_results(results_path)
    if results_path != RESULTS and "deepspeed" not in results:
        results.update({k: v for k, v in load_results().items() if k in ("deepspeed", "seconds")})
    exclusions = read_exclusions(EXCLUSIONS.read_text().splitlines()) if EXCLUSIONS.exists() else {}
    if args.causes:
        listed = TEST_IDS.read_text().split() if TEST_IDS.exists() else []
        denominator = [t for t in listed if not is_excluded(t, exclusions)]
        print(causes_markdown(results.get("slipstream", {}), denominator))
        return 0
    if args.table:
        print(
            format_table(
                table_rows(outcomes(results.get("deepspeed", {})), outcomes(results.get("slipstream", {})), exclusions)
            )
        )
        return 0

    labels = [label for label, _ in FOLDERS]
    chosen = [f.strip() for f in args.folders.split(",") if f.strip()] or labels
    unknown = sorted(set(chosen) - set(labels))
    if unknown:
        raise SystemExit(f"--folders: unknown {unknown}; the folders are {labels}")
    paths, select = pytest_targets([p for label, ps in FOLDERS if label in chosen for p in ps])
    workdir = Path(args.workdir)
    places = {
        "<workdir>": str(workdir.resolve()),
        "<slipstream_src>": str(Path(args.slipstream_src).resolve()) if args.slipstream_src else "",
        "<repo>": str(ROOT),
        "<tmp>": str(Path(tempfile.gettempdir()).resolve()),
    }
    commit = extract(args.deepspeed_repo, args.ref, workdir)
    tests_dir = workdir / "tests"
    results.setdefault("seconds", {})
    results["deepspeed_tests_commit"] = commit
    results["settings"] = {"max_params": args.max_params, "timeout_s": args.timeout, "local_size": 2, "folders": chosen}

    if args.side in ("both", "deepspeed"):
        if not Path(args.peer_python).exists():
            raise SystemExit(f"no peer environment at {args.peer_python}: run `bash bench/make_peer_venv.sh`")
        report = workdir / "deepspeed.jsonl"
        warm_up("deepspeed", args.peer_python, side_env("deepspeed", None))
        seconds = run_side(
            args.peer_python,
            tests_dir,
            paths,
            report,
            side_env("deepspeed", None),
            select=select,
            timeout=args.timeout,
            max_params=args.max_params,
            ids_file=None,
            log=workdir / "deepspeed.log",
        )
        tests, collect_errors = read_jsonl(report.read_text().splitlines() if report.exists() else [])
        tests.update({module: outcome_for(module, tests, collect_errors) for module in collect_errors})
        previous = {t: o for t, o in results.get("deepspeed", {}).items() if folder_of(t) not in chosen}
        results["deepspeed"] = {**previous, **summarise(tests, places)}
        results["seconds"]["deepspeed"] = round(seconds, 1)
        passed = sorted(t for t, o in outcomes(results["deepspeed"]).items() if o == "passed")
        TEST_IDS.write_text("".join(t + "\n" for t in passed if not is_excluded(t, exclusions)))
        save_results(results, results_path)
        print(f"DeepSpeed side: {len(tests)} tests in {seconds:.0f} s, {len(passed)} passed", flush=True)

    if args.side in ("both", "slipstream"):
        wanted = [t for t in TEST_IDS.read_text().split() if folder_of(t) in chosen and not is_excluded(t, exclusions)]
        ids_file = workdir / "slipstream_ids.txt"
        ids_file.write_text("".join(t + "\n" for t in wanted))
        report = workdir / "slipstream.jsonl"
        alias = args.alias or unpack_compat_wheel(args.python, workdir / "deepspeed-compat")
        if args.slipstream_src:
            alias = os.pathsep.join([args.slipstream_src, alias])
            results["slipstream_src"] = portable(str(Path(args.slipstream_src).resolve()), places)
        warm_up("slipstream", args.python, side_env("slipstream", alias))
        seconds = run_side(
            args.python,
            tests_dir,
            paths,
            report,
            side_env("slipstream", alias),
            select=select if args.beyond else [],
            timeout=args.timeout,
            max_params=args.max_params if args.beyond else 0,
            ids_file=None if args.beyond else ids_file,
            log=workdir / "slipstream.log",
        )
        tests, collect_errors = read_jsonl(report.read_text().splitlines() if report.exists() else [])
        ran = {t: outcome_for(t, tests, collect_errors) for t in wanted}
        previous = {t: o for t, o in results.get("slipstream", {}).items() if folder_of(t) not in chosen}
        results["slipstream"] = {**previous, **summarise(ran, places)}
        if args.beyond:
            results["slipstream_beyond"] = beyond_results(results, tests, collect_errors, wanted, chosen, places)
        results["seconds"]["slipstream"] = round(seconds, 1)
        save_results(results, results_path)
        print(f"Slipstream side: {len(wanted)} tests in {seconds:.0f} s", flush=True)

    print(
        format_table(
            table_rows(outcomes(results.get("deepspeed", {})), outcomes(results.get("slipstream", {})), exclusions)
        )
    )
    print(
        f"run times: DeepSpeed {results['seconds'].get('deepspeed', '-')} s, "
        f"Slipstream {results['seconds'].get('slipstream', '-')} s; logs in {workdir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
