"""The package's shape (docs/architecture.md): imports point down the layers, no
import cycle between modules, no module over 500 lines, and the engine never calls the KV
manager (the scheduler alone does). Every import counts, also one inside a function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pagedkv"

#: lowest first; a module may import its own package and anything of a lower or equal layer.
LAYERS = {
    "errors": 0, "cpu_isa": 1, "csrc": 1, "utils": 1, "_bundled": 1, "gguf_header": 1, "attn_layout": 1, "kv": 2, "attention": 3, "model": 4,
    "testing": 4,
    "ops": 2,  # every binding of csrc/: below attention and model (docs/architecture.md)
    "worker": 5, "distributed": 6, "engine": 7, "serving": 8, "examples": 10, "bench": 10, "cli": 11, "__init__": 11,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """pagedkv modules imported anywhere in ``path`` (resolved to module names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import submodule`` depends on the submodule, ``from mod import name``
            # on the module (a package's own __init__ runs first either way: not an edge)
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            if not name.startswith("pagedkv"):
                continue
            while name not in mods and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in mods:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) - {m} for m, p in mods.items()}


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else "__init__"
    return top, LAYERS[top]


def test_every_package_has_a_layer():
    tops = {_layer(m)[0] for m in _modules()}
    assert tops <= set(LAYERS), tops - set(LAYERS)


def test_imports_point_down_the_layers():
    upward = []
    for mod, deps in _graph().items():
        top, lvl = _layer(mod)
        for dep in deps:
            dtop, dlvl = _layer(dep)
            if dep == "pagedkv" and mod != "pagedkv":
                upward.append(f"{mod} -> pagedkv (import the submodule, not the facade)")
            elif dtop != top and dlvl > lvl:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def _server_imports_of_replicas(graph: dict[str, set[str]]) -> list[str]:
    """Arrows from the one-engine server (``pagedkv.serving.*`` outside ``replicas`` and
    ``cli``) into ``pagedkv.serving.replicas``: the replicas sit on top of the server (each
    replica runs it), never under it."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items()
                  if (m == "pagedkv.serving" or m.startswith("pagedkv.serving."))
                  and not m.startswith("pagedkv.serving.replicas")
                  and m != "pagedkv.serving.cli"
                  for d in deps if d == "pagedkv.serving.replicas" or d.startswith("pagedkv.serving.replicas."))


def test_the_server_imports_nothing_of_the_replicas():
    assert _server_imports_of_replicas(_graph()) == []
    assert "pagedkv.serving.replicas.replica" in _graph()  # the package the rule names exists


def test_server_replica_check_is_not_vacuous():
    planted = {"pagedkv.serving.routes": {"pagedkv.serving.replicas.router", "pagedkv.serving.schemas"},
               "pagedkv.serving.cli": {"pagedkv.serving.replicas.launch"},
               "pagedkv.serving.replicas.ingress": {"pagedkv.serving.replicas.router", "pagedkv.serving.schemas"},
               "pagedkv.serving": {"pagedkv.serving.replicas"}}
    assert _server_imports_of_replicas(planted) == ["pagedkv.serving -> pagedkv.serving.replicas",
                                                    "pagedkv.serving.routes -> pagedkv.serving.replicas.router"]


def test_no_import_cycle_between_modules():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_cycle_detector_finds_a_planted_cycle(monkeypatch):
    """The detector above is not vacuous: a cycle a -> b -> a is reported."""
    fake = {"pagedkv.kv.a": {"pagedkv.kv.b"}, "pagedkv.kv.b": {"pagedkv.kv.a"}}
    monkeypatch.setitem(test_no_import_cycle_between_modules.__globals__, "_graph", lambda: fake)
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycle_between_modules()


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_module_size(path: Path):
    n = len(path.read_text().splitlines())
    assert n <= 500, f"{path.relative_to(PKG)} has {n} lines (at most 500)"


def test_engine_makes_no_call_on_the_kv_manager():
    """Only the scheduler drives the KV manager (vLLM v1's rule): engine.py never calls
    ``.kv.<method>`` nor imports ``KVCacheManager``."""
    tree = ast.parse((PKG / "engine" / "engine.py").read_text())
    calls = [
        ast.unparse(n.func) for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Attribute) and n.func.value.attr in ("kv", "kv_manager")
    ]
    assert not calls, calls
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "KVCacheManager" not in names


def test_every_name_imported_from_pagedkv_exists():
    # a name moved between modules leaves a stale import that only fails when its function
    # runs (`pagedkv bench quality` imported markdown_table from bench.common after it moved
    # to bench.report): every ``from pagedkv... import name``, also inside functions, resolves
    import importlib

    mods = _modules()
    stale = []
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pagedkv")):
                continue
            mod = importlib.import_module(node.module)
            stale += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                      if not hasattr(mod, a.name) and f"{node.module}.{a.name}" not in mods]
    assert stale == []


def test_the_runner_owns_the_compiled_step():
    """The device side reads one way: the runner holds the compiled step and calls it or the
    model's forward; the model never knows it is compiled (no ``compiled`` attribute read or
    written in pagedkv.model outside compiled.py itself), and only the worker compiles."""
    offenders = []
    for mod, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if mod.startswith("pagedkv.model") and mod != "pagedkv.model.compiled" \
                    and isinstance(node, ast.Attribute) and node.attr == "compiled":
                offenders.append(f"{mod}: .compiled")
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                if name == "compile_decode" and not mod.startswith(("pagedkv.worker", "pagedkv.model.compiled")):
                    offenders.append(f"{mod}: compile_decode()")
    assert offenders == []


def test_one_declared_step_context():
    """Attention metadata reaches the kernel as an argument, except inside a compiled graph,
    where it goes through the one declared context (``pagedkv.model.compiled.STEP_CONTEXT``)
    and its C++ half (the backend's ``StepTable``). Any other per-thread state in the step
    path is scratch memory, listed here with its reason."""
    allowed = {
        "pagedkv.model.compiled": "STEP_CONTEXT: the compiled step's attend/error",
        "pagedkv.ops.step_op": "StepTable: the C++ half of the step context (prepared LayerArgs)",
        "pagedkv.attention.cpu": "per-thread scratch buffers of the CPU kernel (no state between steps)",
        "pagedkv.model.quant": "shapes_only: a load's key and shape check on its own thread (not step state)",
    }
    found = {}
    for mod, path in _modules().items():
        if not mod.startswith(("pagedkv.model", "pagedkv.attention", "pagedkv.ops", "pagedkv.worker", "pagedkv.engine")):
            continue
        src = path.read_text()
        if "threading.local" in src:
            found[mod] = allowed.get(mod, "undeclared")
    assert found == allowed


def test_no_issue_numbers_in_code_comments():
    """Code says why in its own words: an issue number means nothing to a reader of the code
    (issues live in the tracker, history in git)."""
    import re

    pat = re.compile(r"\b[Ii]ssues? #?\d+")
    hits = [f"{p.relative_to(PKG.parent)}:{i}" for p in [*PKG.rglob("*.py"), *(PKG.parent / "tests").rglob("*.py")]
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert hits == []


def _scheduler_references(path: Path) -> list[str]:
    """Where ``path`` names the scheduler: a name, attribute or parameter ``scheduler`` /
    ``Scheduler``, or an import of ``pagedkv.engine.scheduler``."""
    refs = []
    for n in ast.walk(ast.parse(path.read_text())):
        name = (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                else n.arg if isinstance(n, ast.arg) else None)
        if name is not None and name.lower() == "scheduler":
            refs.append(f"{path.name}:{n.lineno} {name}")
        if isinstance(n, ast.ImportFrom) and n.module == "pagedkv.engine.scheduler":
            refs.append(f"{path.name}:{n.lineno} import")
    return refs


def test_only_the_engine_holds_the_scheduler():
    """The step runs one way (schedule -> execute -> sample -> update -> outputs): sequence
    groups, beam search, the output processor and the rest of the engine package return
    decisions and never hold the scheduler; the engine alone hands them to it. Nothing else
    in the package (server, benchmarks) reads it: they use the engine's snapshot/stats."""
    refs = []
    for path in sorted(PKG.rglob("*.py")):  # the benchmarks and the server too
        if path not in (PKG / "engine" / "scheduler.py", PKG / "engine" / "engine.py"):
            refs += _scheduler_references(path)
    assert refs == []


def test_scheduler_reference_check_is_not_vacuous(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("class G:\n    def __init__(self, scheduler):\n        self.scheduler = scheduler\n")
    assert _scheduler_references(planted) == ["planted.py:2 scheduler", "planted.py:3 scheduler",
                                              "planted.py:3 scheduler"]


def test_scheduler_imports_no_decider():
    """The scheduler knows the decisions, not who takes them: it imports neither the sequence
    groups, the beam search, the output processor nor the sampler (and so needs no model)."""
    deps = _graph()["pagedkv.engine.scheduler"]
    deciders = {f"pagedkv.engine.{m}" for m in ("sequence_group", "beam", "output", "sampler", "engine")}
    assert deps & deciders == set()
    assert not any(d.startswith(("pagedkv.model", "pagedkv.worker", "pagedkv.attention")) for d in deps)


#: config keys that decide which layers slide: read by pagedkv/attn_layout.py alone.
WINDOW_KEYS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern")


def _window_key_reads(source: str) -> list[str]:
    """``x["key"]``, ``x.get("key")`` / any call given the key (``key("attention.sliding_window")``)
    and ``"key" in x`` for a window key (a GGUF ``*.sliding_window`` too). A layer's
    ``attn_options`` (the backend kwargs the model builds from ``ModelConfig.layer_window``) is
    not a config: reads from it do not count."""
    def is_key(node: ast.AST) -> bool:
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and (node.value in WINDOW_KEYS or node.value.endswith(".sliding_window")))

    out = []
    for n in ast.walk(ast.parse(source)):
        hits = ([n.slice] if isinstance(n, ast.Subscript) else n.args if isinstance(n, ast.Call)
                else [n.left] if isinstance(n, ast.Compare) and isinstance(n.ops[0], (ast.In, ast.NotIn)) else [])
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and "attn_options" in ast.unparse(n.func.value):
            continue
        out += [f"line {n.lineno}: {ast.unparse(n)}" for h in hits if is_key(h)]
    return out


def test_only_the_model_config_reader_reads_window_keys():
    reads = {str(p.relative_to(PKG)): r for p in PKG.rglob("*.py")
             if p != PKG / "attn_layout.py" and (r := _window_key_reads(p.read_text()))}
    assert reads == {}
    assert _window_key_reads(
        'w = cfg.get("sliding_window")\nn = cfg["max_window_layers"]\nif "layer_types" in cfg: pass\n'
        'k = key("attention.sliding_window")\nout = {"layer_types": None}\nf(sliding_window=1)\n'
        'w = layer.attn_options.get("sliding_window")'
    ) == ['line 1: cfg.get(\'sliding_window\')', "line 2: cfg['max_window_layers']",
          "line 3: 'layer_types' in cfg", "line 4: key('attention.sliding_window')"]
    assert _window_key_reads((PKG / "attn_layout.py").read_text())  # the reader does read them


#: the device side: only the worker (and a tensor-parallel rank's shard builder) calls these
DEVICE_CALLS = ("load_model", "get_backend", "ModelRunner", "resolve_weights", "auto_weights", "compile_steps")


def _device_calls(source: str) -> list[str]:
    """Calls of a :data:`DEVICE_CALLS` name (plain or as an attribute) in ``source``."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else None
            if name in DEVICE_CALLS:
                out.append(f"line {n.lineno}: {name}()")
    return out


def test_only_the_worker_loads_the_model():
    """The engine package never loads weights, creates a backend, builds a ModelRunner or
    compiles: it asks ``Worker.load`` and ``make_executor`` (pagedkv/worker/worker.py)."""
    calls = {p.name: c for p in sorted((PKG / "engine").glob("*.py")) if (c := _device_calls(p.read_text()))}
    assert calls == {}
    assert _device_calls((PKG / "worker" / "worker.py").read_text())  # the worker does call them


def test_device_call_check_is_not_vacuous():
    planted = ("from pagedkv.model.loader import load_model\nm = load_model(None)\nb = registry.get_backend('cpu')\n"
               "r = ModelRunner(m, b)\nr.compile_steps(max_rows=8)\nload_model_later = 1\n")
    assert _device_calls(planted) == ["line 2: load_model()", "line 3: get_backend()", "line 4: ModelRunner()",
                                      "line 5: compile_steps()"]


#: core modules without their own tests/<pkg>/test_<module>.py: where they are tested instead
#: (each named file must exist). New core modules get their own file.
TESTED_ELSEWHERE = {
    "kv/tiers/plan.py": "tests/kv/test_stores.py",  # KVTransfer's Put/Move/Drop/Load/Clear ops, run by the stores
    "engine/engine.py": "tests/engine/test_api.py",  # LLMEngine's public API
    "engine/llm.py": "tests/engine/test_api.py",  # LLM.generate
}


def _untested_core_modules(root: Path) -> list[str]:
    """Modules of pagedkv/{kv,engine,worker} (``root`` is the checkout) with neither a
    tests/<pkg>/test_<stem>.py nor an entry in :data:`TESTED_ELSEWHERE` naming an existing file."""
    missing = []
    for pkg in ("kv", "engine", "worker"):
        for path in sorted((root / "pagedkv" / pkg).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            rel = str(path.relative_to(root / "pagedkv"))
            if (root / "tests" / pkg / f"test_{path.stem}.py").is_file():
                continue
            other = TESTED_ELSEWHERE.get(rel)
            if other is None or not (root / other).is_file():
                missing.append(rel)
    return missing


def test_core_modules_have_unit_test_files():
    assert _untested_core_modules(PKG.parent) == []
    # no stale exemption: an exempted module exists and still has no file of its own
    stale = [m for m in TESTED_ELSEWHERE if not (PKG / m).is_file()
             or (PKG.parent / "tests" / m.split("/")[0] / f"test_{Path(m).stem}.py").is_file()]
    assert stale == []


def test_core_module_check_is_not_vacuous(tmp_path):
    for rel in ("pagedkv/kv/covered.py", "pagedkv/kv/bare.py", "pagedkv/engine/llm.py", "pagedkv/worker/x.py",
                "pagedkv/kv/__init__.py", "tests/kv/test_covered.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    # engine/llm.py is exempted, but its covering file does not exist in tmp_path
    assert _untested_core_modules(tmp_path) == ["kv/bare.py", "engine/llm.py", "worker/x.py"]


def _writes_through(path: Path, name: str) -> list[str]:
    """Assignments (``=``, ``+=``, ``del``) whose target reaches into ``name``'s state, e.g.
    ``self.scheduler.stats.x += 1`` or ``self.scheduler.running[0] = r``."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        targets = (n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
                   if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            inner = t.value if isinstance(t, (ast.Attribute, ast.Subscript)) else None
            if inner is not None and f".{name}" in f".{ast.unparse(inner)}" and ast.unparse(inner) != "self":
                if name in ast.unparse(inner).split("."):
                    out.append(f"line {n.lineno}: {ast.unparse(t)}")
    return out


def test_the_engine_changes_scheduler_state_only_through_its_methods(tmp_path):
    """Only the scheduler changes its queues, counters and KV manager: the engine calls its
    methods (update, apply, count_finished_request, ...) and never assigns into it."""
    assert _writes_through(PKG / "engine" / "engine.py", "scheduler") == []
    planted = tmp_path / "planted.py"
    planted.write_text("self.scheduler.stats.n += 1\nself.scheduler = 1\nx.scheduler.running[0] = 2\n")
    assert _writes_through(planted, "scheduler") == ["line 1: self.scheduler.stats.n", "line 3: x.scheduler.running[0]"]


# ---- the engine core: input processor -> core step -> output processor ---------------------
#: most lines of ``LLMEngine._step`` (its ``def`` line included): schedule -> execute -> update
MAX_STEP_LINES = 25


def _function_lines(source: str, cls: str, fn: str) -> int:
    """Lines of method ``cls.fn`` in ``source`` (``def`` to its last line, decorators and
    docstring included); 0 when there is no such method."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == fn:
                    first = min([item.lineno, *(d.lineno for d in item.decorator_list)])
                    return item.end_lineno - first + 1
    return 0


def test_the_core_step_fits_on_a_screen():
    """The core loop reads schedule -> execute -> update; features plug in behind hooks and
    the step sampler / output processor, so it stays short."""
    n = _function_lines((PKG / "engine" / "engine.py").read_text(), "LLMEngine", "_step")
    assert 0 < n <= MAX_STEP_LINES, f"LLMEngine._step has {n} lines (at most {MAX_STEP_LINES})"


def test_step_length_check_is_not_vacuous():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_STEP_LINES))
    planted = f"class LLMEngine:\n    @staticmethod\n    def _step(opened):\n{body}"
    assert _function_lines(planted, "LLMEngine", "_step") == MAX_STEP_LINES + 2  # decorator + def + body
    assert _function_lines(planted, "LLMEngine", "step") == 0


#: the engine's optional features: wired by pagedkv/engine/builder.py, never by the core
FEATURE_MODULES = tuple(f"pagedkv.engine.{m}" for m in ("spec_decode", "structured", "beam", "tools")) + tuple(
    f"pagedkv.worker.{m}" for m in ("ngram_proposer", "draft_proposer"))


def _feature_imports(source: str) -> list[str]:
    """Feature modules (:data:`FEATURE_MODULES`) that ``source`` imports, anywhere in it
    (``import m``, ``from m import x``, ``from pagedkv.engine import m``)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
        else:
            continue
        out += [f"line {n.lineno}: {m}" for m in names if m in FEATURE_MODULES]
    return out


def test_the_engine_core_imports_no_feature_module():
    assert _feature_imports((PKG / "engine" / "engine.py").read_text()) == []
    assert _feature_imports((PKG / "engine" / "builder.py").read_text())  # the builder wires them


def test_feature_import_check_is_not_vacuous():
    planted = ("import pagedkv.engine.beam\nfrom pagedkv.engine.spec_decode import make_proposer\n"
               "def f():\n    from pagedkv.engine import structured, sampler\n")
    assert _feature_imports(planted) == ["line 1: pagedkv.engine.beam", "line 2: pagedkv.engine.spec_decode",
                                         "line 4: pagedkv.engine.structured"]


#: what names a detokeniser's state: the output processor's (pagedkv.engine.output.TextState)
DETOKENISER_WORDS = ("text", "detok", "decoded")


def _detokeniser_fields(source: str, cls: str = "Request") -> list[str]:
    """Annotated fields of class ``cls`` in ``source`` whose names hold a
    :data:`DETOKENISER_WORDS` word (``output_text``, ``_text_tokens``, ...)."""
    return [f"line {item.lineno}: {item.target.id}"
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef) and node.name == cls
            for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            and any(w in item.target.id.lower() for w in DETOKENISER_WORDS)]


def test_request_holds_scheduler_state_only():
    """The scheduler's Request carries no detokeniser state (text, decoded counts): the
    output processor keeps its own, per sequence."""
    from dataclasses import fields

    from pagedkv.engine.request import Request

    assert _detokeniser_fields((PKG / "engine" / "request.py").read_text()) == []
    assert not [f.name for f in fields(Request) if any(w in f.name.lower() for w in DETOKENISER_WORDS)]


def test_detokeniser_field_check_is_not_vacuous():
    planted = ("class Request:\n    request_id: str\n    output_text: str = ''\n    _text_tokens: int = 0\n"
               "class Other:\n    text: str = ''\n")
    assert _detokeniser_fields(planted) == ["line 3: output_text", "line 4: _text_tokens"]


def _foreign_private_writes(source: str) -> list[str]:
    """Assignments (``=``, ``+=``, ``del``) to a private attribute (``x._name``) of an object
    other than ``self`` / ``cls``."""
    out = []
    for n in ast.walk(ast.parse(source)):
        targets = (n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
                   if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        out += [f"line {n.lineno}: {ast.unparse(x)}" for t in targets for x in ast.walk(t)
                if isinstance(x, ast.Attribute) and x.attr.startswith("_") and not x.attr.startswith("__")
                and not (isinstance(x.value, ast.Name) and x.value.id in ("self", "cls"))]
    return out


def test_the_engine_package_writes_no_other_objects_private_state():
    """E.g. the output processor once kept its text counters in a Request's private fields;
    each object now changes only its own private attributes."""
    hits = {p.name: h for p in sorted((PKG / "engine").glob("*.py")) if (h := _foreign_private_writes(p.read_text()))}
    assert hits == {}


def test_private_write_check_is_not_vacuous():
    planted = "req._text_tokens = 3\nself._ok = 1\nstate.text = 'x'\nreq._n += 1\ndel other._x\n"
    assert _foreign_private_writes(planted) == ["line 1: req._text_tokens", "line 4: req._n", "line 5: other._x"]


def _block_ceil_divisions(source: str) -> list[str]:
    """Hand-made ceiling divisions by a block size in ``source``: ``-(-a // bs)``,
    ``cdiv(a, bs)``, ``math.ceil(a / bs)`` or ``(a + bs - 1) // bs``, where the divisor's
    source names ``bs`` or ``block_size``."""
    import re

    def by_block(node: ast.AST) -> bool:
        return re.search(r"\b(bs|block_size)\b", ast.unparse(node)) is not None

    out = []
    for n in ast.walk(ast.parse(source)):
        hit = None
        if (isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.BinOp)
                and isinstance(n.operand.op, ast.FloorDiv) and isinstance(n.operand.left, ast.UnaryOp)
                and by_block(n.operand.right)):
            hit = n
        elif isinstance(n, ast.Call) and len(n.args) == 2 and ast.unparse(n.func) in ("cdiv", "utils.cdiv") \
                and by_block(n.args[1]):
            hit = n
        elif isinstance(n, ast.Call) and ast.unparse(n.func) == "math.ceil" and n.args \
                and isinstance(n.args[0], ast.BinOp) and isinstance(n.args[0].op, ast.Div) and by_block(n.args[0].right):
            hit = n
        elif (isinstance(n, ast.BinOp) and isinstance(n.op, ast.FloorDiv) and isinstance(n.left, ast.BinOp)
              and isinstance(n.left.op, ast.Sub) and by_block(n.right) and by_block(n.left)):
            hit = n
        if hit is not None:
            out.append(f"line {n.lineno}: {ast.unparse(hit)}")
    return out


def test_the_engine_counts_blocks_through_blocks_needed():
    """How many KV blocks a number of tokens takes is ``pagedkv.kv.block_table.blocks_needed``
    (window rule included); the engine package never rounds up by the block size itself."""
    hits = {p.name: h for p in sorted((PKG / "engine").glob("*.py")) if (h := _block_ceil_divisions(p.read_text()))}
    assert hits == {}


def test_block_ceil_division_check_is_not_vacuous():
    planted = ("a = -(-used // block_size)\nb = cdiv(n, bs)\nc = math.ceil(t / self.block_size)\n"
               "d = (t + bs - 1) // bs\ne = -(-V // B)\nf = n // bs\ng = blocks_needed(n, bs)\n")
    assert _block_ceil_divisions(planted) == ["line 1: -(-used // block_size)", "line 2: cdiv(n, bs)",
                                              "line 3: math.ceil(t / self.block_size)", "line 4: (t + bs - 1) // bs"]


#: calls that run a model or a proposer: never made by the scheduler (it reserves slots only)
MODEL_CALLS = ("propose", "propose_batch", "propose_drafts", "execute", "forward", "prepare", "model")


def _scheduler_model_use(source: str) -> list[str]:
    """Imports of a proposer, a draft model, the worker or the model package in ``source``
    (``pagedkv.worker.*``, ``pagedkv.model.*``, any module named ``*proposer*`` or
    ``spec_draft``), and calls of :data:`MODEL_CALLS` methods (``x.propose(...)``)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module:
            names = [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MODEL_CALLS:
            out.append(f"line {n.lineno}: call {ast.unparse(n.func)}")
            continue
        else:
            continue
        bad = sorted({m for m in names if m.startswith(("pagedkv.worker", "pagedkv.model"))
                      or "proposer" in m.rsplit(".", 1)[-1] or m.endswith("spec_draft")})
        out += [f"line {n.lineno}: import {m}" for m in bad]
    return out


def test_the_scheduler_imports_no_proposer_and_runs_no_model():
    """Speculation's proposers run on the worker side after a step (``pagedkv.worker.proposer``);
    the scheduler reads the draft ids a request carries and reserves their lookahead slots."""
    assert _scheduler_model_use((PKG / "engine" / "scheduler.py").read_text()) == []


def test_scheduler_model_check_is_not_vacuous():
    planted = ("from pagedkv.worker.draft_proposer import DraftModelProposer\nimport pagedkv.engine.spec_draft\n"
               "from pagedkv.engine.spec_decode import lookahead_cap\n"
               "def f(self, r):\n    d = self.spec.propose(r)\n    self.runner.execute(x)\n    r.num_tokens()\n")
    assert _scheduler_model_use(planted) == [
        "line 1: import pagedkv.worker.draft_proposer", "line 1: import pagedkv.worker.draft_proposer.DraftModelProposer",
        "line 2: import pagedkv.engine.spec_draft", "line 5: call self.spec.propose", "line 6: call self.runner.execute"]


def _proposer_classes(source: str) -> list[str]:
    """Classes in ``source`` that are proposers: named ``*Proposer`` or deriving from one."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.ClassDef) and (n.name.endswith("Proposer") or any(
                ast.unparse(b).rsplit(".", 1)[-1].endswith("Proposer") for b in n.bases)):
            out.append(f"line {n.lineno}: {n.name}")
    return out


def test_proposers_live_in_the_worker_package_and_are_registered():
    """Every proposer class is defined in ``pagedkv/worker/`` (one file each) and named in the
    one registry (``pagedkv.worker.proposer.PROPOSERS``), which points at worker modules."""
    from pagedkv.worker.proposer import PROPOSERS, Proposer, parse_speculative

    outside = {str(p.relative_to(PKG)): h for p in sorted(PKG.rglob("*.py"))
               if p.parent != PKG / "worker" and (h := _proposer_classes(p.read_text()))}
    assert outside == {}
    found = {p.name: _proposer_classes(p.read_text()) for p in sorted((PKG / "worker").glob("*.py"))}
    homes = {name: target.split(":")[0] for name, target in PROPOSERS.items()}
    assert all(m.startswith("pagedkv.worker.") for m in homes.values()) and len(set(homes.values())) == len(homes)
    for name in PROPOSERS:
        cls = parse_speculative(name + (":x" if name == "draft" else ""))[0]
        assert issubclass(cls, Proposer) and cls.__module__ == homes[name]
        assert [c.split(": ")[1] for c in found[cls.__module__.rsplit(".", 1)[1] + ".py"]] == [cls.__name__]


def test_proposer_location_check_is_not_vacuous():
    planted = ("class EagleProposer:\n    pass\nclass Plain:\n    pass\n"
               "class Medusa(proposer.Proposer):\n    pass\nclass Helper(Plain):\n    pass\n")
    assert _proposer_classes(planted) == ["line 1: EagleProposer", "line 5: Medusa"]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_attrs(cls: ast.ClassDef) -> set[str]:
    """Private names a class defines itself: methods, class-body assignments, ``__slots__``
    entries, ``self._x = ...`` / ``cls._x`` / ``object.__setattr__(self, "_x", ...)`` anywhere in it."""
    out: set[str] = set()
    for st in cls.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(st.name)
        for t in st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else []:
            if isinstance(t, ast.Name):
                out.add(t.id)
                if t.id == "__slots__":
                    out |= {e.value for e in ast.walk(st.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    for n in ast.walk(cls):
        targets = (n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
                   if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        out |= {x.attr for t in targets for x in ast.walk(t) if isinstance(x, ast.Attribute)
                and isinstance(x.value, ast.Name) and x.value.id in ("self", "cls")}
        if (isinstance(n, ast.Call) and ast.unparse(n.func) in ("setattr", "object.__setattr__") and len(n.args) >= 2
                and isinstance(n.args[0], ast.Name) and n.args[0].id == "self" and isinstance(n.args[1], ast.Constant)):
            out.add(n.args[1].value)
    return {a for a in out if isinstance(a, str) and _is_private(a)}


def _foreign_private_reads(source: str) -> list[str]:
    """Reads of ``self._x`` / ``cls._x`` in a class where ``_x`` is defined neither by the
    class nor by a base class of the same module (a mixin reaching into its host's state)."""
    tree = ast.parse(source)
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}

    def defined(cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str]:
        out = _own_private_attrs(cls)
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id in classes and b.id not in seen | {cls.name}:
                out |= defined(classes[b.id], seen | {cls.name})
        return out

    hits = set()
    for cls in classes.values():
        ok = defined(cls)
        hits |= {(n.lineno, f"line {n.lineno}: {cls.name} reads {n.value.id}.{n.attr}") for n in ast.walk(cls)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
                 and _is_private(n.attr) and n.attr not in ok}
    return [h for _, h in sorted(hits)]


#: known reads of a private attribute a class does not define, with the reason each stays
FOREIGN_PRIVATE_READS_ALLOWED = {
    # a QuantLinear subclass calling its base's kernel helper (pagedkv/model/quant.py): real
    # inheritance across modules, not a mixin; model/gguf_*.py is reworked on another branch
    "model/gguf_native.py": ["GGUFLinear reads self._linear"],
}


def test_no_class_reads_private_state_it_does_not_own():
    """Collaborators receive what they need explicitly (e.g. the KV manager's group managers,
    prefix lookup and step fences); no class reads a ``self._x`` that neither it nor a base
    class of its own module defines (the old ``KVCacheManager(PrefixLookup, StepFences)``
    mixins read the manager's ``_gtables`` / ``_gtags`` / ``_tables``)."""
    hits = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(PKG))
        allowed = FOREIGN_PRIVATE_READS_ALLOWED.get(rel, [])
        if found := [h for h in _foreign_private_reads(p.read_text()) if h.split(": ", 1)[1] not in allowed]:
            hits[rel] = found
    assert hits == {}


def test_foreign_private_read_check_is_not_vacuous():
    planted = (
        "class Lookup:\n    def find(self):\n        return self._gtables[0]\n"
        "class Base:\n    __slots__ = ('_ids',)\n    def _helper(self):\n        self._n = 1\n"
        "class Manager(Lookup, Base):\n    def __init__(self):\n        self._gtables = [{}]\n"
        "    def go(self):\n        return self._helper(), self._n, self._ids, self._tags, self.__len__\n"
        "class Keys:\n    def __post_init__(self):\n        object.__setattr__(self, '_base', b'')\n"
        "    def key(self):\n        return self._base, other._secret\n"
    )
    assert _foreign_private_reads(planted) == ["line 3: Lookup reads self._gtables", "line 12: Manager reads self._tags"]


def test_the_kv_worker_and_testing_packages_count_blocks_through_blocks_needed():
    """Like the engine: outside ``kv/block_table.py`` (where ``blocks_needed`` and the per-request
    ``request_blocks_needed`` live) the KV core, the worker and the conformance kit never round
    tokens up to blocks by hand."""
    hits = {str(p.relative_to(PKG)): h for d in ("kv", "worker", "testing") for p in sorted((PKG / d).rglob("*.py"))
            if p != PKG / "kv" / "block_table.py" and (h := _block_ceil_divisions(p.read_text()))}
    assert hits == {}


# ---- native bindings live in pagedkv.ops; the model reads backend capabilities ------------

#: modules outside pagedkv.ops that may import ctypes and load a system library, with why (they
#: are still checked for csrc sources and the builder)
CTYPES_ELSEWHERE = {"pagedkv.utils": "omp_pause_resource_all of the system's libgomp (not a csrc source)",
                    "pagedkv.attention.prefault": "madvise of the system's libc (not a csrc source)"}


def _native_binding_uses(source: str, ctypes_ok: bool = False) -> list[str]:
    """What in ``source`` builds or loads a native library: an import of ``ctypes`` (unless
    ``ctypes_ok``), of ``pagedkv.csrc``, ``pagedkv.ops.build`` or ``torch.utils.cpp_extension``;
    a call of ``compile_c``/``CDLL``/``load_inline``/``cdll.*``/``BuiltOnce``; a ``source("x.c")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
            for name in names:
                if (name == "ctypes" or name.startswith("ctypes.")) and not ctypes_ok \
                        or name.startswith(("pagedkv.csrc", "pagedkv.ops.build", "torch.utils.cpp_extension")):
                    found.append(f"line {node.lineno}: import {name}")
                    break
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            owner = ast.unparse(fn.value).rsplit(".", 1)[-1] if isinstance(fn, ast.Attribute) else ""
            src = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if name in ("compile_c", "load_inline", "BuiltOnce") or (name == "CDLL" or owner == "cdll") and not ctypes_ok \
                    or (name == "source" and isinstance(src, str) and src.endswith((".c", ".cpp"))):
                found.append(f"line {node.lineno}: {ast.unparse(fn)}()")
    return sorted(found, key=lambda f: int(f.split(":")[0].split()[1]))


def test_every_native_binding_lives_in_ops():
    """No module outside ``pagedkv.ops`` builds, loads or calls into a ``csrc`` library: the
    callers in attention/, model/, engine/ go through ``pagedkv.ops.<library>``."""
    offenders = []
    for mod, path in _modules().items():
        if mod == "pagedkv.ops" or mod.startswith("pagedkv.ops."):
            continue
        offenders += [f"{mod}: {u}" for u in _native_binding_uses(path.read_text(), ctypes_ok=mod in CTYPES_ELSEWHERE)]
    assert offenders == []


def test_native_binding_check_is_not_vacuous():
    planted = ("import ctypes\nfrom pagedkv.ops.build import compile_c, source\nfrom pagedkv import csrc\n"
               "lib = compile_c(source('qmm.c'), 'x', [])\nctypes.CDLL('x.so')\nctypes.cdll.LoadLibrary('y')\n"
               "from torch.utils.cpp_extension import load_inline\nsource('notes.txt')\n")
    assert _native_binding_uses(planted) == [
        "line 1: import ctypes", "line 2: import pagedkv.ops.build.compile_c", "line 3: import pagedkv.csrc",
        "line 4: compile_c()", "line 4: source()", "line 5: ctypes.CDLL()", "line 6: ctypes.cdll.LoadLibrary()",
        "line 7: import torch.utils.cpp_extension.load_inline"]
    assert _native_binding_uses("import ctypes\nctypes.CDLL('libgomp.so.1')\ncompile_c(p, 's', [])\n",
                                ctypes_ok=True) == ["line 3: compile_c()"]


def test_each_csrc_library_has_one_binding_module_in_ops():
    """``pagedkv/csrc/<stem>.c|.cpp`` is built by ``pagedkv/ops/<stem>.py`` and by no other module."""
    builders: dict[str, list[str]] = {}
    for mod, path in _modules().items():
        for name in re.findall(r"\bsource\(\"([^\"]+)\"\)", path.read_text()):
            if mod not in builders.setdefault(name, []):  # a module may name its source twice
                builders[name].append(mod)
    sources = sorted(p.name for p in (PKG / "csrc").iterdir() if p.suffix in (".c", ".cpp"))
    assert sources and {s: builders.get(s) for s in sources} == {s: [f"pagedkv.ops.{Path(s).stem}"] for s in sources}


def _backend_probes(source: str) -> list[str]:
    """``getattr``/``hasattr`` calls on an attention backend (a name or attribute ``backend``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and "backend" in ast.unparse(node.args[0]).lower():
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_model_reads_backend_capabilities_not_probes():
    """The model, the worker and the engine take a backend's optional paths from its declared
    ``capabilities`` (``pagedkv.attention.base.BackendCapabilities``) and its layout from
    ``pagedkv.attention.layouts.backend_layout``, never by ``getattr``/``hasattr`` on it; the
    runner is told the cache kind (``latent=``), it does not probe the model's config."""
    offenders = [f"{mod}: {p}" for mod, path in _modules().items()
                 if mod.startswith(("pagedkv.model.", "pagedkv.worker.", "pagedkv.engine."))
                 for p in _backend_probes(path.read_text())]
    assert offenders == []
    runner = (PKG / "worker" / "runner.py").read_text()
    assert "getattr(" not in runner and "hasattr(" not in runner


def test_backend_probe_check_is_not_vacuous():
    planted = ("f = getattr(backend, 'write_and_forward', None)\nok = hasattr(self.backend, 'step_table')\n"
               "n = getattr(layer, 'mlp', None)\n")
    assert _backend_probes(planted) == ["line 1: getattr(backend, 'write_and_forward', None)",
                                        "line 2: hasattr(self.backend, 'step_table')"]


def _bench_files_outside_their_package(bench: Path, benches: dict[str, str]) -> list[str]:
    """Breaches of "a benchmark's files live in its package" in ``bench`` (pagedkv/bench):
    a module directly in ``bench`` named after a benchmark package (``serve.py`` or
    ``serve_peer.py`` beside ``serve/``), and a benchmark package whose runner is not its
    ``run.py`` as registered in ``benches`` (:data:`pagedkv.bench.cli.BENCHES`)."""
    packages = sorted(p.name for p in bench.iterdir() if (p / "__init__.py").is_file())
    out = [f"{path.name} beside {pkg}/" for path in sorted(bench.glob("*.py")) for pkg in packages
           if path.stem == pkg or path.stem.startswith(pkg + "_")]
    out += [f"{pkg}/: runner {benches.get(pkg)!r}" for pkg in packages
            if benches.get(pkg) != f"pagedkv.bench.{pkg}.run" or not (bench / pkg / "run.py").is_file()]
    return out


def test_a_benchmarks_files_live_in_its_package():
    from pagedkv.bench.cli import BENCHES

    assert _bench_files_outside_their_package(PKG / "bench", BENCHES) == []
    assert (PKG / "bench" / "serve" / "peer.py").is_file()  # the packages the rule reads exist


def test_bench_package_check_is_not_vacuous(tmp_path):
    for rel in ("serve/__init__.py", "serve/run.py", "serve_peer.py", "serve.py", "servers.py", "common.py",
                "quality.py", "spec/__init__.py", "spec/peer.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    benches = {"serve": "pagedkv.bench.serve.run", "spec": "pagedkv.bench.spec", "quality": "pagedkv.bench.quality"}
    assert _bench_files_outside_their_package(tmp_path, benches) == [
        "serve.py beside serve/", "serve_peer.py beside serve/", "spec/: runner 'pagedkv.bench.spec'"]
