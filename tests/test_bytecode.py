"""runner/bytecode.py: where the engine's libraries have no bytecode beside them and Python may not
write it there, the runner keeps it in a private folder of its cache; elsewhere it changes nothing."""
import json
import os
import py_compile
import importlib.util
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runner import bytecode

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Two importable packages: `bare` without bytecode, `built` with bytecode beside its source;
    Python may not write bytecode (PYTHONDONTWRITEBYTECODE=1, as container images set)."""
    site = tmp_path / "site"
    for name in ("bare", "built"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"NAME = {name!r}\n")
    monkeypatch.setattr(sys, "pycache_prefix", None)  # restored after the test, as are these
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(bytecode, "_state", dict(bytecode._state))
    init = site / "built" / "__init__.py"
    py_compile.compile(str(init), cfile=importlib.util.cache_from_source(str(init)), doraise=True)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_packages_without_bytecode_python_may_not_write_are_named(packages, monkeypatch):
    assert bytecode.missing_bytecode(["bare", "built", "no_such_package_here"]) == ["bare"]
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python writes it beside the source itself
    assert bytecode.missing_bytecode(["bare"]) == []


def test_a_private_folder_is_set_where_bytecode_is_missing(packages, tmp_path):
    environ = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin"}
    root = tmp_path / "cache" / "pycache"
    prefix = bytecode.use_cache(root, environ, packages=["bare", "built"])
    assert prefix is not None and Path(prefix).parent == root
    assert stat.S_IMODE(Path(prefix).stat().st_mode) == 0o700  # Python runs what it finds there
    assert sys.pycache_prefix == prefix and sys.dont_write_bytecode is False
    # the processes the runner starts (a forked or spawned engine core, the grammar measurement) follow
    assert environ == {"PYTHONPYCACHEPREFIX": prefix, bytecode.INHERITED: prefix, "PATH": "/bin"}
    made = bytecode.state()
    assert made["prefix"] == prefix and made["set_by_runner"] and "bare" in made["reason"]


def test_a_relative_cache_folder_becomes_absolute(packages, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a child in another folder must find the same bytecode
    prefix = bytecode.use_cache(Path("rel") / "pycache", {}, packages=["bare"])
    assert Path(prefix).is_absolute() and Path(prefix).parent == tmp_path / "rel" / "pycache"


@pytest.mark.parametrize("case", ["bytecode beside", "switched off", "prefix already set", "cannot be written",
                                  "others can write"])
def test_nothing_changes_otherwise(packages, tmp_path, monkeypatch, case):
    """An unusable folder would hide every module's bytecode (slower than none) or let others plant
    code: it is refused, and the reason kept."""
    environ = {"PYTHONDONTWRITEBYTECODE": "1"}
    names, root = ["bare"], tmp_path / "ours"
    if case == "bytecode beside":
        names = ["built"]
    elif case == "switched off":
        environ[bytecode.SWITCH] = "off"
    elif case == "prefix already set":
        monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))
    elif case == "cannot be written":
        (tmp_path / "a-file").write_text("")
        root = tmp_path / "a-file" / "pycache"
    else:
        root.mkdir()
        root.chmod(0o777)
    before = (sys.pycache_prefix, sys.dont_write_bytecode, dict(environ))
    assert bytecode.use_cache(root, environ, packages=names) is None
    assert (sys.pycache_prefix, sys.dont_write_bytecode, environ) == before
    made = bytecode.state()
    assert not made["set_by_runner"] and made["reason"]
    if case in ("cannot be written", "others can write"):
        assert "no bytecode beside bare, but" in made["reason"]


def test_preload_decides_before_the_import_starts(monkeypatch):
    """`runner run` imports vLLM in a thread while it checks the input: the prefix must be set before."""
    import threading

    from runner.engines import preload
    from runner.spec import EngineConfig

    order = []
    monkeypatch.setattr(bytecode, "engine_bytecode", lambda: order.append("bytecode"))

    class Thread:
        def __init__(self, target, name, daemon):
            self.name = name

        def start(self):
            order.append(self.name)

    monkeypatch.setattr(threading, "Thread", Thread)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # preload sets vLLM's offline variables
    job = type("Job", (), {"engine": EngineConfig(model="m")})()
    preload(job, "vllm")
    assert order == ["bytecode", "runner-preload"]


CHILD = """
import sys
from pathlib import Path
from runner.bytecode import use_cache
print(use_cache(Path(sys.argv[1]), packages=["bare"]))
import bare
"""


def test_the_first_process_writes_and_later_ones_read(packages, tmp_path):
    """Real processes, as a container image runs them (PYTHONDONTWRITEBYTECODE=1): the first
    writes the bytecode under the cache folder, none beside the source; the second reads it."""
    root = tmp_path / "pycache"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env |= {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(packages)])}
    written = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(root)], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert Path(proc.stdout.strip()).parent == root
        pyc = list(root.rglob("bare/__init__.*.pyc"))  # the prefix mirrors the source's path
        assert len(pyc) == 1
        written.append(pyc[0].stat().st_mtime_ns)
    assert written[0] == written[1]  # read, not written again
    assert not (packages / "bare" / "__pycache__").exists()


def test_folders_no_run_used_for_a_month_are_removed(packages, tmp_path):
    """Each torch or vLLM upgrade names a new folder (hundreds of MB of bytecode): the old ones go
    once no process has used them for KEEP_DAYS; recent ones, other files and the folder in use stay."""
    import time

    root = tmp_path / "pycache"
    old_days = time.time() - (bytecode.KEEP_DAYS + 10) * 86400

    def folder(name, used_at=None, marker=True):
        d = root / name
        (d / "x").mkdir(parents=True)
        (d / "x" / "m.pyc").write_bytes(b"0")
        if used_at is not None:
            if marker:
                (d / bytecode.USED).touch()
                os.utime(d / bytecode.USED, (used_at, used_at))
            else:
                os.utime(d, (used_at, used_at))
        return d

    folder("0123456789abcdef", old_days)  # an older vLLM's, unused for 40 days
    folder("1111111111111111", old_days, marker=False)  # made before markers: its own time counts
    folder(".2222222222222222.removing-99", old_days)  # a removal that was killed midway
    folder("fedcba9876543210", time.time() - 5 * 86400)  # another venv's, used 5 days ago
    folder("notes", old_days)  # not a name this module makes
    prefix = bytecode.use_cache(root, {}, packages=["bare"])
    assert sorted(p.name for p in root.iterdir()) == sorted([Path(prefix).name, "fedcba9876543210", "notes"])
    assert (Path(prefix) / bytecode.USED).exists()
    assert sorted(bytecode.state()["pruned"]) == ["0123456789abcdef", "1111111111111111", "2222222222222222"]


RAY_DRIVER = """
import functools, json, sys, types
from runner import bytecode
bytecode.use_cache = functools.partial(bytecode.use_cache, packages=["bare"])  # `bare` stands for vLLM
from runner.engines.ray_cluster import ensure_ray
ray_cfg = types.SimpleNamespace(address=sys.argv[1] or None, env=json.loads(sys.argv[2]))
ensure_ray(types.SimpleNamespace(spec=types.SimpleNamespace(ray=ray_cfg)))
import ray
print(json.dumps(ray.SEEN | {"state": bytecode.state()}))
"""


@pytest.mark.parametrize("cluster", ["local", "address", "switched off in ray.env"])
def test_a_ray_driver_decides_before_importing_ray(packages, tmp_path, cluster):
    """`executor: ray`: the driver never imports vLLM, but a local cluster's processes (raylet, each
    replica's actor) start from its environment when Ray starts: the prefix must be set, and
    PYTHONDONTWRITEBYTECODE gone, before Ray is imported (a stand-in `ray` records what it found).
    A remote cluster's workers inherit nothing from the driver, and `ray.env` can switch it off:
    then nothing changes."""
    stub = tmp_path / "stub" / "ray"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "import os, sys\n"
        "SEEN = {'prefix': sys.pycache_prefix, 'env': os.environ.get('PYTHONPYCACHEPREFIX'),\n"
        "        'no_bytecode': os.environ.get('PYTHONDONTWRITEBYTECODE')}\n"
        "def is_initialized():\n    return True\n")
    drop = ("PYTHONPYCACHEPREFIX", bytecode.SWITCH, bytecode.INHERITED, "RAY_ADDRESS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env |= {"PYTHONDONTWRITEBYTECODE": "1", "RUNNER_CACHE": str(tmp_path / "cache"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(packages), str(stub.parent)])}
    address = "ray://head:10001" if cluster == "address" else ""
    ray_env = {bytecode.SWITCH: "0"} if cluster.startswith("switched") else {}
    proc = subprocess.run([sys.executable, "-c", RAY_DRIVER, address, json.dumps(ray_env)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if cluster != "local":
        assert seen["prefix"] is None and seen["env"] is None and seen["no_bytecode"] == "1"
        assert seen["state"]["reason"] == bytecode.UNDECIDED  # a replica decides for itself
        return
    assert seen["prefix"] is not None and Path(seen["prefix"]).parent == tmp_path / "cache" / "pycache"
    assert seen["env"] == seen["prefix"] and seen["no_bytecode"] is None


INHERITS = """
import sys
from runner import bytecode
print(bytecode.use_cache(bytecode.Path(sys.argv[1]), packages=["bare"]), bytecode.state()["set_by_runner"])
"""


def test_a_process_started_by_the_runner_records_the_prefix_it_inherited(packages, tmp_path):
    """A Ray actor starts with the driver's prefix in its environment: it says the runner set it
    (not a prefix of the user's), and uses it; a prefix the user set stays the user's."""
    env = {k: v for k, v in os.environ.items() if k not in (bytecode.SWITCH, bytecode.INHERITED)}
    env |= {"PYTHONPATH": os.pathsep.join([str(ROOT), str(packages)])}
    theirs = str(tmp_path / "theirs")
    for marked in (True, False):
        env_run = env | {"PYTHONPYCACHEPREFIX": theirs} | ({bytecode.INHERITED: theirs} if marked else {})
        proc = subprocess.run([sys.executable, "-c", INHERITS, str(tmp_path / "root")], env=env_run,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ([theirs, "True"] if marked else ["None", "False"])


@pytest.mark.parametrize("package", ["bare", "built"])
def test_a_process_decides_once(packages, tmp_path, monkeypatch, package):
    """preload and every engine of a run (calibration starts several) ask: the first call decides,
    set or not, and the later ones return its answer without looking again."""
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    calls = []
    real = bytecode.use_cache
    monkeypatch.setattr(bytecode, "use_cache", lambda root: calls.append(root) or real(root, {}, packages=[package]))
    first = bytecode.engine_bytecode()
    if package == "bare":  # no bytecode beside it: set
        assert first is not None and Path(first).parent == tmp_path / "cache" / "pycache"
    else:
        assert first is None and "beside" in bytecode.state()["reason"]
    assert bytecode.engine_bytecode() == first and len(calls) == 1
