"""Where the peer harness (`../shared/peer/peer_bench.py`, its README) finds the benchmark's step functions: they live in
`rnn_darts.engine.bench`. Written by hand: nbdev does not generate it."""
from rnn_darts.engine.bench import *   # noqa: F401,F403
from rnn_darts.engine.bench import SEARCH_DROPOUTS, STEP, arch_updater, op_count, search_step   # noqa: F401
