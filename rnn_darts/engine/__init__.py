"""The engine below the model: how a step runs, never what it computes.

`plan` decides, once per learner, which path runs (eager, compiled, CUDA graphs, fused Triton kernels) in which
precision, and says every fallback; `runners` build what runs a cell's time steps for that plan; `kernels` are the
product and deferred-gradient kernels of the eager step; `fused` the Triton kernels (`triton_ops`: each op's Triton
forms, which the ops' registry names); `attach` gives a learner its plan, runner and the callbacks of its path; `graphs` the captured CUDA
graphs; `speed` the precision, compile and thread callbacks; `bench` times the paths and `check` proves each equal
to eager. The model (`rnn_darts.model`) computes what its runner gives it. Written by hand: nbdev does not generate it.
"""

from importlib import import_module as _import_module

# What the model's maths (`rnn_darts.model`, `loss`, `ops`) may take from the engine, and the module of each: the products
# it computes with (`linear`, `mm_t`, `fastest`), its tanh, the mark of a weight whose gradient the runner defers, and
# the runner a model has until a plan gives it another. Imported on first use, so `rnn_darts.engine.plan` stays torch-free
INTERFACE = dict(linear='kernels', mm_t='kernels', fastest='kernels', tanh='kernels', Deferred='kernels', EAGER='runners')

def __getattr__(name):
    "An `INTERFACE` name, from its module (PEP 562)"
    if name not in INTERFACE: raise AttributeError(f"module 'rnn_darts.engine' has no attribute {name!r}")
    val = getattr(_import_module(f"rnn_darts.engine.{INTERFACE[name]}"), name)
    globals()[name] = val
    return val
