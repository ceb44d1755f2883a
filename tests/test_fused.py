"The fused time step (`rnn_darts.fused`): Triton's kernels, run by its interpreter on a CPU, equal the eager step; a model trains through them as through the eager one"
import pytest, torch
pytest.importorskip("triton", reason="the fused step is Triton kernels; Triton comes with torch's CUDA wheels")
from rnn_darts.genotypes import DARTS_V1, DARTS_V2, ENAS
from rnn_darts.model import DartsCell, DartsRnn, DartsRnnShared
from rnn_darts.fused import FusedDerivedStep, FusedPlan

def fused_and_eager(n, bs, dtype, genotype):
    "The fused step and the eager one (`DartsCell.step`) from the same input, state, mask and weights: outputs and gradients of a random loss (the weights' from the tap, as `WeightGroup` sums them)"
    torch.manual_seed(0)
    c = DartsCell(n, n, genotype).to(dtype)
    Ws = [c.W0[n:].t()] + [c.kid_rows(k) for k in c.kids.values() if k]
    W = torch.cat(Ws).detach().requires_grad_()
    views = torch.split(W, [w.shape[0] for w in Ws])
    xw, h = torch.randn(bs, 2 * n, dtype=dtype, requires_grad=True), torch.randn(bs, n, dtype=dtype, requires_grad=True)
    mh = torch.bernoulli(torch.full((bs, n), 0.75, dtype=dtype)) / 0.75
    tap = torch.zeros(bs, W.shape[0], dtype=dtype, requires_grad=True)
    out, A = FusedDerivedStep.apply(xw, h, tap, W.detach(), mh, FusedPlan(c, 'cpu'))
    ref = c.step(xw, h, mh, (views[0], views[1:]))
    g = torch.randn_like(out)
    gx, gh, gtap = torch.autograd.grad(out, [xw, h, tap], g)
    ends = torch.tensor([0] + [w.shape[0] for w in Ws]).cumsum(0).tolist()
    gW = torch.cat([gtap[:, a:b].t() @ A[k] for k, (a, b) in enumerate(zip(ends[:-1], ends[1:]))])
    return (out, gx, gh, gW), (ref, *torch.autograd.grad(ref, [xw, h, W], g))

@pytest.mark.parametrize('n, bs, dtype, genotype', [(8, 5, torch.float64, DARTS_V2), (40, 19, torch.float32, ENAS)])
def test_the_fused_step_equals_the_eager_step(n, bs, dtype, genotype):
    """Output, ∂/∂input, ∂/∂state and the weights' gradient (through the tap) against autograd on the eager step. nhid 40 and
    bs 19 take two tiles of columns and two programs, both with masked edges; ENAS's cell has every activation"""
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for a, b, what in zip(*fused_and_eager(n, bs, dtype, genotype), ('output', 'input', 'state', 'weights')):
        torch.testing.assert_close(a, b, **tol, msg=what)

@pytest.mark.slow
@pytest.mark.parametrize('shared', [False, True])
def test_a_model_through_the_fused_step_gives_the_eager_loss_and_gradients(shared):
    """A derived model (and random search's shared one, whose node matrices are copied together) with dropout: the loss,
    every weight's gradient (summed from the taps every 8 time steps; 10 time steps: a full stash and a rest) and an
    evaluation loss without gradients, fused against eager"""
    torch.manual_seed(0)
    drop = dict(dropout=0.1, dropouth=0.2, dropoutx=0.2, dropouti=0.1)
    m = (DartsRnnShared(30, 8, 8, **drop).use(DARTS_V1) if shared else DartsRnn(30, DARTS_V2, 8, 8, **drop)).train()
    x, y = torch.randint(0, 30, (4, 10)), torch.randint(0, 30, (4, 10))
    def run():
        m.reset(); m.train()
        loss = m.loss(x, y, advance=False)
        grads = torch.autograd.grad(loss, m.flat.params)
        m.eval()
        with torch.no_grad(): ev = m.loss(x, y, stream='valid', advance=False)
        return [loss.detach(), *grads, ev]
    with m.frozen_masks():
        eager = run()
        m.cell.fuse_step()
        fused = run()
    for a, b in zip(fused, eager): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

@pytest.mark.slow
def test_a_fused_time_step_is_two_kernels():
    """A training step of the fused derived model launches one kernel per time step forward and one backward, and about
    four more per time step (the tap's zero, the state's gradient, their sums): counted as `launch_count` counts, the
    interpreter's launches being profiled ranges, from 3 to 6 time steps. 12 s: the profiler records every operation of
    the interpreted kernels"""
    from rnn_darts.bench import launch_count, weight_step
    torch.manual_seed(0)
    m = DartsRnn(30, DARTS_V2, 8, 8).train()
    m.cell.fuse_step()
    def count(T):
        x, y = torch.randint(0, 30, (4, T)), torch.randint(0, 30, (4, T))
        weight_step(m, x, y)
        return launch_count(lambda: weight_step(m, x, y))
    c3, c6 = count(3), count(6)
    assert (c3['generated'], c6['generated']) == (6, 12), (c3, c6)
    assert (c6['total'] - c3['total']) / 3 <= 7, (c3, c6)   # Inductor's compiled step: 34 to 42 per time step (10a_measurements)
