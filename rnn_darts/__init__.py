"""rnn_darts: DARTS (differentiable architecture search) for recurrent language-model cells, as a fastai v2 application.

The public API is available at the top level (`from rnn_darts import search_learner, lm_dls, ...`). It is imported
lazily, on first use of a name: `import rnn_darts` (and `import rnn_darts.cli`) stays cheap and does not import
fastai. Written by hand: nbdev does not generate this file (`put_version_in_init = false`).
"""
from importlib import import_module as _import_module
from importlib.metadata import version as _version, PackageNotFoundError as _PackageNotFoundError

try: __version__ = _version('rnn_darts')
except _PackageNotFoundError: __version__ = '0.1.0'   # run from a checkout without installing (pyproject.toml's version)

_API = {
    'rnn_darts.learner': ['search_learner', 'train_learner', 'evaluate', 'eval_weights', 'DartsLearner', 'SeqCrossEntropy',
                          'flat_splitter', 'load_preset'],
    'rnn_darts.config': ['RunConfig', 'SearchConfig', 'TrainConfig', 'StudyConfig'],
    'rnn_darts.model': ['DartsRnn', 'DartsRnnSearch', 'DartsRnnShared', 'n_weights'],
    'rnn_darts.loss': ['linear_cross_entropy'],
    'rnn_darts.random_search': ['choose_cell'],
    'rnn_darts.runs': ['resume_learner'],
    'rnn_darts.data': ['Corpus', 'numbers_corpus', 'read_corpus', 'write_corpus', 'get_ptb', 'lm_dls', 'search_stream',
                       'test_dl', 'StreamDL', 'SearchStream'],
    'rnn_darts.genotypes': ['Genotype', 'PRIMITIVES', 'DARTS_V1', 'DARTS_V2', 'ENAS', 'GENOTYPES', 'load_genotype',
                            'save_genotype', 'check_genotype', 'derive_genotype', 'sample_genotype'],
    'rnn_darts.ops': ['register_op', 'OPS', 'PAPER_OPS'],
    'rnn_darts.space': ['SearchSpace'],
    'rnn_darts.core': ['set_seed', 'get_device', 'read_preset'],
    'rnn_darts.callbacks.arch': ['ArchParamUpdate'],
    'rnn_darts.callbacks.random_arch': ['RandomArch'],
    'rnn_darts.callbacks.training': ['SeqLenLR', 'FlatGradClip'],
    'rnn_darts.engine.speed': ['FusedDecoderLoss'],
    'rnn_darts.callbacks.asgd': ['ASGDSwitch'],
    'rnn_darts.callbacks.checkpoint': ['Checkpoint'],
    'rnn_darts.callbacks.divergence': ['DivergenceGuard'],
    'rnn_darts.callbacks.logs': ['plain_output'],
    'rnn_darts.callbacks.tensorboard': ['TensorBoardLog'],
}
_WHERE = {name: mod for mod, names in _API.items() for name in names}
__all__ = ['__version__', *_WHERE]

def __getattr__(name):
    "Import the module that defines `name` on first use (PEP 562)"
    mod = _WHERE.get(name)
    if mod is None: raise AttributeError(f"module 'rnn_darts' has no attribute {name!r}")
    val = getattr(_import_module(mod), name)
    globals()[name] = val
    return val

def __dir__(): return sorted({*globals(), *_WHERE})
