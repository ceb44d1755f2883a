"""One room per idea (issue 28): no module of the package imports, directly or through others, a module that imports
it back, counting the imports inside functions too; the settings schema is read by the learners without importing
the command line."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ('rnn_darts', 'callbacks')

def modules() -> dict:
    "module name -> file, for every module of the packages (their `__init__` files excepted: they import lazily, by name)"
    return {f"{p}.{f.stem}": f for p in PACKAGES for f in sorted((ROOT/p).glob('*.py')) if f.stem != '__init__'}

def imports_of(path, mods) -> set:
    "The package modules `path` imports anywhere in it: at the top, inside functions, `from PACKAGE import module` too"
    res = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import): res |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            res.add(n.module)
            res |= {f"{n.module}.{a.name}" for a in n.names}
    return res & set(mods)

def cycle(graph) -> list|None:
    "A circle of imports in `graph` (module -> modules it imports), as a list of modules, or None"
    state, stack = {}, []
    def visit(m):
        state[m] = 'open'; stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 'open': return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)): return c
        state[m] = 'done'; stack.pop()
    for m in sorted(graph):
        if m not in state and (c := visit(m)): return c

def test_cycle_finder_finds_a_planted_circle():
    assert cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': set()}) == ['a', 'b', 'c', 'a']
    assert cycle({'a': {'b'}, 'b': set(), 'c': {'a', 'b'}}) is None

def test_no_import_circle():
    mods = modules()
    graph = {m: imports_of(f, mods) - {m} for m, f in mods.items()}
    assert 'rnn_darts.options' in graph['rnn_darts.learner'] and 'rnn_darts.runs' in graph['rnn_darts.study']   # the graph sees function-level imports
    assert cycle(graph) is None, ' -> '.join(cycle(graph))

def test_the_command_line_is_imported_by_nothing_in_the_package():
    "`rnn_darts.cli` parses, dispatches and prints: the library (learners, presets, studies, runs) never reaches into it"
    mods = modules()
    users = [m for m, f in mods.items() if m != 'rnn_darts.cli' and 'rnn_darts.cli' in imports_of(f, mods)]
    assert users == []
