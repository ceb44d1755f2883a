"""The settings' one source (`rnn_darts.config`): the learners take a config or keyword overrides of one, the command
line and `run.json` read its defaults, and no default is written twice in the package"""
import ast, re
from dataclasses import fields
from pathlib import Path
import pytest
from rnn_darts.space import SearchSpace
from rnn_darts.config import SearchConfig, TrainConfig, StudyConfig, RunConfig
from rnn_darts.learner import search_learner, train_learner, VocabDLs
from rnn_darts.genotypes import DARTS_V2

PKG = Path(__file__).resolve().parents[1]/'rnn_darts'
DLS = VocabDLs(list('abcdefgh'))

def test_a_learner_takes_a_config_or_keywords_and_nothing_else():
    "The same settings by config and by keyword give the same learner; a misspelt keyword and a positional size are refused by name"
    by_config = search_learner(DLS, None, SearchConfig(emsize=8, nhid=8, mode='first'), checkpoint=False)
    by_keyword = search_learner(DLS, None, emsize=8, nhid=8, mode='first', checkpoint=False)
    assert by_config.config == by_keyword.config == SearchConfig(emsize=8, nhid=8, mode='first', checkpoint=False)
    assert by_config.model.nhid == 8 and by_config.arch_param_update.mode == 'first'
    over = search_learner(DLS, None, SearchConfig(emsize=8, nhid=8), arch_lr=1e-2, checkpoint=False)
    assert over.arch_param_update.arch_lr == 1e-2 and over.config.nhid == 8            # a keyword overrides the config
    with pytest.raises(TypeError, match="search_learner\\(\\) got an unexpected keyword argument 'arch_lrr'"):
        search_learner(DLS, None, arch_lrr=1e-2)
    with pytest.raises(TypeError, match="config must be a SearchConfig, got int 16; settings go by keyword"):
        search_learner(DLS, None, 16, 16)
    with pytest.raises(TypeError, match="train_learner\\(\\) got an unexpected keyword argument 'arch_lr'"):
        train_learner(DLS, DARTS_V2, arch_lr=1e-2)
    t = train_learner(DLS, DARTS_V2, TrainConfig(emsize=8, nhid=8, nonmono=2), checkpoint=False)
    assert t.asgd_switch.nonmono == 2 and t.model.nhid == 8 and t.config.nonmono == 2
    from rnn_darts.core import UsageError
    with pytest.raises(UsageError, match="dropouth is a dropout probability"): search_learner(DLS, None, dropouth=1.)   # a field's check, as the flag's
    for make, msg in ((lambda: SearchConfig(nhid=0), "nhid must be an integer >= 1, got 0"),                           # a config checks itself as it is made:
                      (lambda: SearchConfig(method='gdas', relax='snas'), "method gdas sets relax to 'gdas'"),       # its fields, its method's parts,
                      (lambda: TrainConfig(emsize=8), "emsize (8) must equal nhid (850)"),                             # the rules between settings
                      (lambda: StudyConfig(final_epochs=0), "final_epochs must be an integer >= 1")):
        with pytest.raises(UsageError, match=re.escape(msg)): make()
    with pytest.raises(UsageError, match="arch_lr applies to the architecture weights α, which random search"):        # the command line's rule
        search_learner(DLS, None, mode='random', arch_lr=1e-2)

def test_the_command_line_resolves_onto_the_configs_fields():
    "A command's resolved settings are its config's fields, no more and no fewer; the help's defaults are the config's"
    from rnn_darts.options import resolve_settings
    from rnn_darts.cli import command_parser
    for cmd, cls in (('search', SearchConfig), ('train', TrainConfig)):
        s = resolve_settings(cmd, 'quick')
        assert list(s) == list(cls.names()) and cls.of(s).asdict() == s
    help = ' '.join(command_parser('search').format_help().split())
    assert f"--arch-lr X learning rate of α (Adam), > 0 (default: {SearchConfig.arch_lr})" in help
    assert f"NT-ASGD patience (epochs without improvement before averaging starts) (default: {TrainConfig.nonmono})" in ' '.join(command_parser('train').format_help().split())
    assert f"--nonmono N NT-ASGD patience (epochs) [{TrainConfig.nonmono}]" in ' '.join(command_parser('train', brief=True).format_help().split())

def _literal_defaults(tree):
    "(name, value, line) of every keyword default of a function and every keyword argument of a `dict(...)` that is a literal"
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            pairs += list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults))
            pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            pairs = [(arg.arg, d) for arg, d in pairs]
        elif isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'dict':
            pairs = [(k.arg, k.value) for k in node.keywords if k.arg]
        for name, d in pairs:
            try: yield name, ast.literal_eval(d), d.lineno
            except ValueError: pass

def test_each_settings_default_is_written_once():
    "No function default or `dict(...)` entry in the package repeats a setting's default: it reads the config instead"
    defaults = {}
    for cls in (SearchConfig, TrainConfig, StudyConfig):
        for f in fields(cls): defaults.setdefault(f.name, set()).add(repr(f.default))
    repeats = [f"{p.name}:{line} {name}={v!r}" for p in sorted(PKG.rglob('*.py')) if p.name not in ('config.py', '_modidx.py')
               for name, v, line in _literal_defaults(ast.parse(p.read_text()))
               if name in defaults and repr(v) in defaults[name] and v not in (None, False, True, '', 0, 0.)]
    assert repeats == [], repeats

def test_each_list_of_names_is_written_once():
    "No tuple, list or set of names in the package repeats one of the config's registries (modes, relaxations, α's settings, methods): it reads the registry"
    import rnn_darts.config as C
    regs = {k: set(getattr(C, k)) for k in ('MODES', 'ARCH_MODES', 'RELAXATIONS', 'TEMPERED', 'DRAWN', 'ALPHA_PARTS', 'ALPHA_ONLY', 'METHODS', 'FAMILY')}
    repeats = [f"{p.name}:{node.lineno} {k}" for p in sorted(PKG.rglob('*.py')) if p.name not in ('config.py', '_modidx.py')
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, (ast.Tuple, ast.List, ast.Set))
               for k, names in regs.items() if {getattr(e, 'value', None) for e in node.elts} == names]
    assert repeats == [], repeats

def test_the_configs_import_no_torch():
    "The command line reads the configs before it decides to import torch: `rnn-darts -h` stays fast"
    import subprocess, sys
    code = "import sys, rnn_darts.config, rnn_darts.options; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr

def test_a_settings_flag_help_and_check_are_its_config_fields():
    "A field with a help text is a flag of its command with that text; one without has no flag; its check is the one run on it"
    from rnn_darts.core import UsageError
    from rnn_darts.options import command_flags, check_settings
    for cmd, cls in (('search', SearchConfig), ('train', TrainConfig)):
        flags = command_flags(cmd)
        for f in fields(cls):
            assert (f.name in flags) == (f.metadata['help'] is not None), (cmd, f.name)
            if f.name in flags: assert flags[f.name][1] == f.metadata['help'], (cmd, f.name)
    assert command_flags('search')['bs'][1] != command_flags('train')['bs'][1]   # the search's own text where it differs
    for k, bad in (('top', 0), ('seed', -1), ('bptt', 1), ('lr', 0.), ('wd', -1e-3), ('dropouth', 1.), ('relax', 'max')):
        with pytest.raises(UsageError, match=f"--{k}"): check_settings({k: bad})
    from rnn_darts.cli import command_parser
    from rnn_darts.study import study_settings, check_study
    help = ' '.join(command_parser('study').format_help().split())
    for f in fields(StudyConfig): assert ' '.join(f.metadata['help'].split()) in help, f.name   # the study's flags: StudyConfig's texts
    s, src = study_settings(short_epochs=0)
    with pytest.raises(UsageError, match="--short-epochs must be an integer >= 1, got 0"): check_study(s, src)

FACTS = ('check', 'group', 'brief', 'graph', 'space', 'resume')   # what a setting is as a flag and to the run, whichever command

def test_each_flag_is_declared_once_with_its_group_and_line():
    """Every flag of `rnn-darts search | train` is declared once (a config field with a help, or a `STEERING` entry) with
    a group of `GROUPS` and a line for -h, and -h's tables are those declarations read: a flag added without a group or a
    line, or a table written by hand again, fails here"""
    from rnn_darts.config import GROUPS, STEERING, declarations
    from rnn_darts.options import (FLAG_ORDER, FLAG_GROUPS, FLAG_SUMMARY, HELP_ORDER, FLAGS, CONTROL, CONTROL_HELP,
                                   SWITCHES, command_flags)
    d = declarations()
    flags = {k for cmd in ('search', 'train') for k in command_flags(cmd)}
    named = {f.name for cls in (SearchConfig, TrainConfig) for f in fields(cls) if f.metadata['help'] is not None}
    assert flags == named | set(STEERING) == set(FLAGS) == set(FLAG_ORDER) and len(FLAG_ORDER) == len(flags)
    assert set(HELP_ORDER) <= flags, set(HELP_ORDER) - flags   # the order lists no flag that is gone
    bad = [k for k in FLAG_ORDER if d[k]['group'] not in GROUPS or not isinstance(d[k]['brief'], str) or not d[k]['brief'].strip()]
    assert bad == [], f"flags declared without a group of GROUPS or a brief (-h's line): {bad}"
    assert list(FLAG_GROUPS) == list(GROUPS) and FLAG_GROUPS == {g: tuple(k for k in FLAG_ORDER if d[k]['group'] == g) for g in GROUPS}
    assert FLAG_SUMMARY == {k: d[k]['brief'] for k in FLAG_ORDER}
    assert (CONTROL, CONTROL_HELP) == ({k: s['type'] for k, s in STEERING.items()}, {k: s['help'] for k, s in STEERING.items()})
    assert SWITCHES == ('resume', 'overwrite') and all(CONTROL[k] is bool for k in SWITCHES)
    for k in set(SearchConfig.names()) & set(TrainConfig.names()):   # one flag of both commands: its help and default may differ
        a, b = SearchConfig.__dataclass_fields__[k].metadata, TrainConfig.__dataclass_fields__[k].metadata
        assert {x: a[x] for x in FACTS} == {x: b[x] for x in FACTS}, k

def test_a_role_declared_is_in_the_table_read_off_it():
    "A setting declared with a role is in the table `declared` reads off that role, and out of it without; a group must be one of -h's"
    from dataclasses import dataclass
    from rnn_darts.config import setting, like, declared
    @dataclass(frozen=True)
    class Made:
        a: int = setting(1, 'an a', 'pos_int', group='data', brief='a', graph=2, space=True)
        b: float = setting(0., 'a b', 'prob', group='model and weights', brief='b', graph='mask', resume=True, meta='bee')
        c: str = setting('')
    assert declared('space', Made) == {'a': True} and declared('resume', Made) == {'b': True} and declared('meta', Made) == {'b': 'bee'}
    assert declared('graph', Made) == {'a': 2, 'b': 'mask'} and declared('group', Made) == {'a': 'data', 'b': 'model and weights'}
    @dataclass(frozen=True)
    class Again(Made):
        a: int = like(Made, 'a', 3, space=False)
    assert declared('space', Again) == {} and declared('graph', Again) == {'a': 2, 'b': 'mask'} and Again().a == 3
    with pytest.raises(ValueError, match="group 'speeds' is none of data, model and weights"): setting(1, 'x', group='speeds', brief='x')
    with pytest.raises(TypeError, match="spaec is no part of a declaration"): like(Made, 'a', spaec=True)

def test_the_tables_read_off_the_roles_keep_their_settings():
    """What the roles make, pinned: the settings a compile key names (its JSON as it was, so the ledgers of the steps
    compiled before stay valid), what a resume may change and may never change, what a checkpoint records of each kind
    of model: a role dropped or given by mistake fails here"""
    import json
    from rnn_darts.config import SHAPES, MASKS, CELL, STEERING, compile_key
    from rnn_darts.runs import RESUME_FREE, SPACE
    from rnn_darts.callbacks.checkpoint import model_meta
    from rnn_darts.model import DartsRnn, DartsRnnSearch, DartsRnnShared
    assert SHAPES == ('emsize', 'nhid', 'nodes', 'ops', 'edge_norm', 'bs', 'eval_bs', 'mode', 'relax', 'method', 'perturb', 'precision')
    assert (MASKS, CELL) == (('dropout', 'dropouth', 'dropoutx', 'dropouti', 'dropoute'), 'genotype')
    assert json.loads(compile_key(SearchConfig(dropouth=0.).asdict(), 'search', 'cpu'))[2:] == [
        'search', 'cpu', [300, 300, 8, 'tanh,relu,sigmoid,identity', False, 256, 10, 'second', 'softmax', None, 'none', 'fp32'],
        [True, False, True, True, False], None]
    assert json.loads(compile_key(TrainConfig(genotype='ENAS').asdict(), 'train', 'cpu'))[2:] == [
        'train', 'cpu', [850, 850, None, '', None, 64, 10, None, None, None, None, 'fp32'], [True] * 5, 'ENAS']
    assert set(RESUME_FREE) == {'epochs', 'out', 'device', 'threads', 'checkpoint_every', 'tensorboard'}
    assert SPACE == ('ops', 'nodes', 'edge_norm')
    said = re.search(r'unless it may change on resume: ([^)]*)\)', STEERING['resume']['help']).group(1)   # --resume's help says them
    assert set(said.split(', ')) == {'--' + k.replace('_', '-') for k in RESUME_FREE if k != 'out'}, said
    kinds = {'search': DartsRnnSearch(10, 8, 8, space=SearchSpace(nodes=3)), 'shared': DartsRnnShared(10, 8, 8), 'derived': DartsRnn(10, DARTS_V2, 8, 8)}
    metas = {kind: model_meta(m) for kind, m in kinds.items()}
    assert {kind: set(m) for kind, m in metas.items()} == dict(
        search={'kind', 'ntoken', 'emsize', 'nhid', 'nodes', 'relax', 'ops', 'edge_norm'},
        shared={'kind', 'ntoken', 'emsize', 'nhid', 'nodes', 'ops'}, derived={'kind', 'ntoken', 'emsize', 'nhid', 'genotype'})
    assert metas['search'] == dict(kind='search', ntoken=10, emsize=8, nhid=8, nodes=3, relax='softmax',
                                   ops=['tanh', 'relu', 'sigmoid', 'identity'], edge_norm=False)
