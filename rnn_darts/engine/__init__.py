"""The engine below the model: how a step runs, never what it computes.

`plan` decides, once per learner, which path runs (eager, compiled, CUDA graphs, fused Triton kernels) in which
precision, and says every fallback; `runners` build what runs a cell's time steps for that plan; `kernels` are the
product and deferred-gradient kernels of the eager step; `fused` the Triton kernels (`triton_ops`: each op's Triton
forms, which the ops' registry names); `attach` gives a learner its plan, runner and the callbacks of its path; `graphs` the captured CUDA
graphs; `speed` the precision, compile and thread callbacks; `bench` times the paths and `check` proves each equal
to eager. The model (`rnn_darts.model`) computes what its runner gives it. Written by hand: nbdev does not generate it.
"""
