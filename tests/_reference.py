"""The tests' one reference: DARTS' recurrent cell, its language model and its architecture step written the textbook way.

As the paper's equations read and as the original code (quark0/darts, `rnn/model_search.py` and `rnn/architect.py`)
computes them, with none of the project's machinery: separate parameters (`W0`, one `W_i` per node), a Python list of
node states, one matmul per edge and one term per op, BatchNorm after every node; the unrolled second-order step builds
a fresh model and loads a `state_dict` copy of the updated weights, the finite differences move each parameter in turn,
clipping loops over the parameter list. Every test that checks the project's math against a plain implementation
imports it from here; it is not part of the installed package.
"""
import math
import torch, torch.nn as nn, torch.nn.functional as F
from rnn_darts.genotypes import PRIMITIVES, PAPER_NODES
from rnn_darts.ops import PAPER_OPS
from rnn_darts.model import DartsRnnSearch, NodeNorm
from rnn_darts.engine.bench import STEP

ACT = dict(tanh=torch.tanh, relu=torch.relu, sigmoid=torch.sigmoid, identity=lambda x: x,   # the paper's, then others by their formulas
           gelu=lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), silu=lambda x: x / (1 + torch.exp(-x)))

def _masked(x, m): return x if m is None else x * m

def plain_init(x_t, h, W0, mx=None, mh=None):
    "s0 = h + σ(c0) (tanh(h0) − h), with [c0|h0] = [x|h] W0"
    c0, h0 = (torch.cat([_masked(x_t, mx), _masked(h, mh)], -1) @ W0).chunk(2, -1)
    return h + c0.sigmoid() * (h0.tanh() - h)

def plain_search_step(x_t, h, W0, Ws, probs, mx=None, mh=None, norm=lambda s, i: s, ops=PAPER_OPS):
    "One time step of the search cell: every node mixes every earlier node through `probs` = softmax(α) (columns: none, then `ops`), one matmul per edge, one term per op"
    states = [norm(plain_init(x_t, h, W0, mx, mh), 0)]
    row = 0
    for i in range(1, len(Ws) + 1):
        s = 0
        for j in range(i):
            c, hh = (_masked(states[j], mh) @ Ws[i - 1]).chunk(2, -1)
            c = c.sigmoid()
            for k, op in enumerate(ops, 1):   # column 0, `none`, adds nothing
                s = s + probs[row + j, k] * (states[j] + c * (ACT[op](hh) - states[j]))
        row += i
        states.append(norm(s, i))
    return torch.stack(states[1:]).mean(0)

def plain_derived_step(x_t, h, W0, Ws, genotype, mx=None, mh=None):
    "One time step of a derived cell: node i applies its op to its one predecessor; the output is the mean of `concat`"
    states = [plain_init(x_t, h, W0, mx, mh)]
    for i, (op, pred) in enumerate(genotype.recurrent):
        c, hh = (_masked(states[pred], mh) @ Ws[i]).chunk(2, -1)
        states.append(states[pred] + c.sigmoid() * (ACT[op](hh) - states[pred]))
    return torch.stack([states[i] for i in genotype.concat]).mean(0)

def run_plain(step, x, h):
    "Run `step(x_t, h)` over the time steps of `x` (T, bs, n); the stacked outputs"
    outs = []
    for t in range(x.shape[0]):
        h = step(x[t], h); outs.append(h)
    return torch.stack(outs)

class PlainSearchRnn(nn.Module):
    "The DARTS search language model written per edge and per op, with its parameters kept separate"
    def __init__(self, ntoken, nhid, dropout=0., dropouth=0., dropoutx=0., dropouti=0., dropoute=0., nodes=PAPER_NODES):
        super().__init__()
        self.args = dict(ntoken=ntoken, nhid=nhid, dropout=dropout, dropouth=dropouth, dropoutx=dropoutx,
                         dropouti=dropouti, dropoute=dropoute, nodes=nodes)
        self.ntoken, self.nhid, self.steps = ntoken, nhid, nodes   # the original's name for the nodes
        steps = nodes
        self.dropout, self.dropouth, self.dropoutx, self.dropouti, self.dropoute = dropout, dropouth, dropoutx, dropouti, dropoute
        self.encoder = nn.Embedding(ntoken, nhid)
        nn.init.uniform_(self.encoder.weight, -0.04, 0.04)
        self.W0 = nn.Parameter(torch.empty(2 * nhid, 2 * nhid).uniform_(-0.04, 0.04))
        self.Ws = nn.ParameterList([nn.Parameter(torch.empty(nhid, 2 * nhid).uniform_(-0.04, 0.04)) for _ in range(steps)])
        self.decoder_bias = nn.Parameter(torch.zeros(ntoken))
        self.bn = NodeNorm(steps + 1, nhid)   # s0 and every node: their own running statistics
        self.alpha = nn.Parameter(1e-3 * torch.randn(steps * (steps + 1) // 2, len(PRIMITIVES)))
        self.bn_update = True   # False in architecture passes: batch statistics, running ones untouched

    def weight_parameters(self): return [p for n, p in self.named_parameters() if n != 'alpha']
    def named_weights(self): return [(n, p) for n, p in self.named_parameters() if n != 'alpha']

    def new(self):
        "A fresh model with the same hyper-parameters and α (the original `Network.new`)"
        m = PlainSearchRnn(**self.args).to(self.alpha).train(self.training)
        with torch.no_grad(): m.alpha.copy_(self.alpha)
        m.bn_update = self.bn_update
        return m

    def norm(self, s, i):
        if not self.training:   # running statistics; a batch mean square above 1 (training's value) is scaled back to 1
            z = (s - self.bn.running_mean[i]) / (self.bn.running_var[i] + self.bn.eps).sqrt()
            return z / z.pow(2).mean().sqrt().clamp(min=1.)
        if not self.bn_update: return F.batch_norm(s, None, None, training=True, eps=self.bn.eps)
        self.bn.num_batches_tracked[i] += 1
        return F.batch_norm(s, self.bn.running_mean[i], self.bn.running_var[i], training=True, momentum=0.1, eps=self.bn.eps)

    def _mask(self, shape, p, like):
        if not self.training or not p: return None
        return like.new_empty(shape).bernoulli_(1 - p).div_(1 - p)

    def cell(self, x_t, h, mx, mh, probs):
        return plain_search_step(x_t, h, self.W0, self.Ws, probs, mx, mh, self.norm)

    def forward(self, x, hidden=None):
        "Logits (bs, T, ntoken) for `x` (bs, T) from `hidden`, and the new hidden state"
        bs, T = x.shape
        w = self.encoder.weight
        me = self._mask((self.ntoken, 1), self.dropoute, w)
        emb = F.embedding(x.t(), w if me is None else w * me)
        mi = self._mask((1, bs, self.nhid), self.dropouti, emb)
        if mi is not None: emb = emb * mi
        mx, mh = self._mask((bs, self.nhid), self.dropoutx, emb), self._mask((bs, self.nhid), self.dropouth, emb)
        h = emb.new_zeros(bs, self.nhid) if hidden is None else hidden
        probs = F.softmax(self.alpha, dim=-1)
        outs = []
        for t in range(T):
            h = self.cell(emb[t], h, mx, mh, probs); outs.append(h)
        out = torch.stack(outs)
        mo = self._mask((1, bs, self.nhid), self.dropout, out)
        if mo is not None: out = out * mo
        return F.linear(out, self.encoder.weight, self.decoder_bias).transpose(0, 1), h.detach()

    def loss(self, x, y, hidden=None):
        logits, h = self(x, hidden)
        return F.cross_entropy(logits.reshape(-1, self.ntoken), y.reshape(-1)), h

def plain_from(model: DartsRnnSearch) -> PlainSearchRnn:
    "A `PlainSearchRnn` with `model`'s weights, α, BatchNorm statistics and dropouts"
    c = model.cell
    p = PlainSearchRnn(model.ntoken, model.nhid, model.dropout, c.dropouth, c.dropoutx, model.dropouti, model.dropoute,
                       model.nodes).to(device=model.alpha.device, dtype=model.alpha.dtype).train(model.training)
    with torch.no_grad():
        p.encoder.weight.copy_(model.encoder.weight); p.decoder_bias.copy_(model.decoder_bias)
        p.W0.copy_(c.W0)
        for i in range(1, model.nodes + 1): p.Ws[i - 1].copy_(c.W(i))
        p.alpha.copy_(model.alpha)
        p.bn.load_state_dict(c.bn.state_dict())
    return p

def plain_clip(grads, max_norm):
    "Clip a list of gradients in place to total norm `max_norm`; returns the coefficient, at most 1"
    if not max_norm: return 1.
    total = sum(g.norm() ** 2 for g in grads) ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads: g.mul_(coef)
    return torch.clamp(coef, max=1.)

def plain_unrolled(model, theta):
    "A fresh model whose weights are the flat vector `theta` (a `state_dict` copy)"
    new, sd, off = model.new(), model.state_dict(), 0
    for n, p in model.named_weights():
        sd[n] = theta[off:off + p.numel()].view_as(p); off += p.numel()
    new.load_state_dict(sd)
    return new

def plain_hvp(model, vector, trn, h_trn, r=1e-2):
    "∇²_{α,w} L_t · v by central differences, moving each parameter in turn"
    params = model.weight_parameters()
    R = r / torch.cat([v.reshape(-1) for v in vector]).norm()
    with torch.no_grad():
        for p, v in zip(params, vector): p.add_(R * v)
    gp = torch.autograd.grad(model.loss(*trn, h_trn)[0], model.alpha)[0]
    with torch.no_grad():
        for p, v in zip(params, vector): p.sub_(2 * R * v)
    gn = torch.autograd.grad(model.loss(*trn, h_trn)[0], model.alpha)[0]
    with torch.no_grad():
        for p, v in zip(params, vector): p.add_(R * v)
    return (gp - gn) / (2 * R)

def plain_hypergrad_first(model, val, h_val):
    "∇α L_v; returns it, the loss and the validation stream's next hidden state"
    loss, h = model.loss(*val, h_val)
    return torch.autograd.grad(loss, model.alpha)[0], loss.detach(), h

def plain_hypergrad_second(model, trn, val, h_trn, h_val, eta, wd, clip, r=1e-2):
    "The unrolled hypergradient as the original `Architect` computes it (through a fresh model)"
    params = model.weight_parameters()
    grads = list(torch.autograd.grad(model.loss(*trn, h_trn)[0], params))
    c = plain_clip(grads, clip)
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    dtheta = torch.cat([g.reshape(-1) for g in grads]) + wd * theta
    unrolled = plain_unrolled(model, theta - eta * dtheta)
    loss, h = unrolled.loss(*val, h_val)
    loss.backward()
    vector = [p.grad for p in unrolled.weight_parameters()]
    plain_clip(vector, clip)
    return unrolled.alpha.grad - eta * c * plain_hvp(model, vector, trn, h_trn, r), loss.detach(), h

class PlainSearchStep:
    "The plain search step: architecture step (`first` or `second`), Adam on α, then an SGD weight step"
    def __init__(self, model, mode='second', lr=STEP['lr'], wd=STEP['wd'], clip=STEP['clip']):
        self.model, self.mode, self.lr, self.wd, self.clip = model, mode, lr, wd, clip
        self.arch_opt = torch.optim.Adam([model.alpha], lr=STEP['arch_lr'], betas=STEP['arch_betas'], weight_decay=STEP['arch_wd'])
        self.opt = torch.optim.SGD(model.weight_parameters(), lr=lr)
        self.h_trn = self.h_val = None

    def __call__(self, trn, val):
        m = self.model
        m.bn_update = False
        if self.mode == 'first': g, _, self.h_val = plain_hypergrad_first(m, val, self.h_val)
        else: g, _, self.h_val = plain_hypergrad_second(m, trn, val, self.h_trn, self.h_val, self.lr, self.wd, self.clip)
        m.bn_update = True
        m.alpha.grad = g
        self.arch_opt.step(); self.arch_opt.zero_grad()
        m.alpha.requires_grad_(False)
        loss, self.h_trn = m.loss(*trn, self.h_trn)
        loss.backward()
        nn.utils.clip_grad_norm_(m.weight_parameters(), self.clip)
        self.opt.step(); self.opt.zero_grad()
        m.alpha.requires_grad_(True)
        return loss.detach()
