"Tests of rnn_darts.plot: every picture is a real file of its kind and shows the data it was given"
import io, json, math, re, shutil
from pathlib import Path

import numpy as np, pandas as pd, pytest
from PIL import Image

import rnn_darts.plot as P
import rnn_darts.reports as R
from rnn_darts.genotypes import DARTS_V1, DARTS_V2, ENAS, PRIMITIVES, Genotype, derive_genotype

MAGIC = {'png': b'\x89PNG', 'pdf': b'%PDF', 'gif': b'GIF8'}
HAS_DOT = shutil.which('dot') is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="graphviz's `dot` is not on the PATH (apt-get install graphviz)")


def check_file(p, kind):
    p = Path(p)
    assert p.is_file() and p.stat().st_size > 0, p
    data = p.read_bytes()
    if kind == 'svg': assert b'<svg' in data[:2000], p
    else: assert data.startswith(MAGIC[kind]), (p, data[:8])
    return data


def history(epochs=4, nodes=8, seed=0, relax='softmax'):
    "A synthetic history.json list: weights drifting toward a fixed choice, genotypes derived from them"
    rng = np.random.default_rng(seed)
    n = nodes * (nodes + 1) // 2
    a, drift = rng.normal(size=(n, len(PRIMITIVES))), rng.normal(size=(n, len(PRIMITIVES)))
    res = []
    for e in range(epochs):
        z = a + 0.7 * e * drift
        w = np.exp(z) / np.exp(z).sum(1, keepdims=True) if relax == 'softmax' else 1 / (1 + np.exp(-z))
        g = derive_genotype(w, nodes)
        res.append(dict(epoch=e, genotype=dict(recurrent=[list(x) for x in g.recurrent], concat=list(g.concat)),
                        weights=w.tolist(), relax=relax))
    return res


def make_run(d, command='search', epochs=4, asgd_epoch=2, with_log=True):
    "A synthetic run folder as `rnn-darts search|train` writes it"
    d = Path(d); d.mkdir(parents=True, exist_ok=True)
    vl = [6.6 - 0.25 * e + (0.3 if e == epochs - 1 else 0) for e in range(epochs)]   # last epoch is not the best
    if with_log:
        df = pd.DataFrame(dict(epoch=range(epochs), train_loss=[v + 0.3 for v in vl], valid_loss=vl,
                               perplexity=np.exp(vl), time=['01:05'] * epochs))
        if command == 'search': df['search_loss'] = [v + 0.1 for v in vl]
        df.to_csv(d/'log.csv', index=False)
    run = dict(command=command, settings=dict(epochs=epochs, bptt=35, lr=20.0, data='ptb|small', nhid=300),
               device='NVIDIA H100 80GB HBM3' if command == 'train' else 'cpu', asgd_epoch=asgd_epoch,
               epoch_times=[65.0 + e for e in range(epochs)], best_valid_loss=min(vl))
    if command == 'search':
        h = history(epochs)
        (d/'history.json').write_text(json.dumps(h))
        run['genotype'] = h[-1]['genotype']
        (d/'genotype.json').write_text(json.dumps(h[-1]['genotype']))
    else: run['genotype'] = dict(recurrent=[list(x) for x in ENAS.recurrent], concat=list(ENAS.concat))
    (d/'run.json').write_text(json.dumps(run))
    return d, run


@pytest.fixture
def no_dot(monkeypatch, tmp_path):
    "Hide graphviz: an empty PATH, so the lookup finds no `dot`"
    empty = tmp_path/'empty_bin'; empty.mkdir()
    monkeypatch.setenv('PATH', str(empty))
    assert P.dot_path() is None


# ---------------------------------------------------------------- genotype diagrams

def test_no_op_but_sigmoid_is_drawn_green():
    """Each built-in op its own colour, and none but sigmoid's a green (gelu's olive read as sigmoid's green): every other
    coloured one (and a registered op's) at least 45° of hue from it"""
    import colorsys, matplotlib as mpl
    from rnn_darts.ops import OPS
    from rnn_darts.plot import op_color
    hsv = lambda op: colorsys.rgb_to_hsv(*mpl.colors.to_rgb(op_color(op)))
    assert len({op_color(op) for op in [*OPS, 'none']}) == len(OPS) + 1
    green = hsv('sigmoid')[0] * 360
    for op in [*OPS, 'user_a', 'user_b', 'user_c']:
        h, sat, _ = hsv(op)
        if op != 'sigmoid' and sat > 0.25: assert min(abs(h * 360 - green), 360 - abs(h * 360 - green)) >= 45, (op, op_color(op))

@pytest.mark.parametrize('g', [DARTS_V2, ENAS], ids=['DARTS_V2', 'ENAS'])
def test_dot_source_matches_genotype(g):
    src = P.genotype_dot(g)
    edges = re.findall(r'"(\d+)" -> "(\d+)" \[label="(\w+)"', src)
    assert {(int(p), int(i)): op for p, i, op in edges} == {(p, i): op for i, (op, p) in enumerate(g.recurrent, 1)}
    assert sorted(int(c) for c in re.findall(r'"(\d+)" -> "h_t"', src)) == sorted(g.concat)
    assert '"x_t" -> "0"' in src and '"h_{t-1}" -> "0"' in src


def test_genotype_from_json_and_errors(tmp_path):
    p = tmp_path/'g.json'
    p.write_text(json.dumps(dict(recurrent=[list(x) for x in DARTS_V2.recurrent], concat=list(DARTS_V2.concat))))
    assert P.genotype_dot(p) == P.genotype_dot(DARTS_V2) == P.genotype_dot(json.loads(p.read_text()))
    with pytest.raises(ValueError, match="unknown picture format 'jpg'"): P.plot_genotype(DARTS_V2, tmp_path/'a.jpg')
    with pytest.raises(ValueError, match="unknown op 'conv'"): P.genotype_dot(([('conv', 0)], [1]))


@pytest.mark.parametrize('fmt', ['png', 'svg', 'pdf'])
def test_plot_genotype_without_dot(no_dot, tmp_path, fmt):
    out = P.plot_genotype(ENAS, tmp_path/f'cell.{fmt}')
    assert out == tmp_path/f'cell.{fmt}'
    data = check_file(out, fmt)
    if fmt == 'svg':
        txt = data.decode()
        assert 'Generated by graphviz' not in txt and 'matplotlib' in txt.lower()
        texts = re.findall(r'<text[^>]*>([^<]*)</text>', txt)
        for op in {op for op, _ in ENAS.recurrent}:
            assert texts.count(op) == sum(o == op for o, _ in ENAS.recurrent), op   # one label per edge
        for i in range(len(ENAS.recurrent) + 1): assert str(i) in texts


def test_plot_genotype_engine_dot_without_dot(no_dot, tmp_path):
    with pytest.raises(RuntimeError, match='not on the PATH'): P.plot_genotype(DARTS_V2, tmp_path/'c.png', engine='dot')


def test_plot_genotype_inline_without_dot(no_dot):
    from matplotlib.figure import Figure
    fig = P.plot_genotype(DARTS_V2)
    assert isinstance(fig, Figure)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert sorted(l for l in labels if l in PRIMITIVES) == sorted(op for op, _ in DARTS_V2.recurrent)


def test_fallback_when_lookup_patched(monkeypatch, tmp_path):
    monkeypatch.setattr(P, 'dot_path', lambda: None)
    txt = check_file(P.plot_genotype(DARTS_V2, tmp_path/'c.svg'), 'svg').decode()
    assert 'Generated by graphviz' not in txt


@needs_dot
@pytest.mark.parametrize('fmt', ['png', 'svg', 'pdf'])
def test_plot_genotype_with_dot(tmp_path, fmt):
    data = check_file(P.plot_genotype(DARTS_V2, tmp_path/f'cell.{fmt}', title='DARTS_V2'), fmt)
    if fmt == 'svg':
        txt = data.decode()
        assert 'Generated by graphviz' in txt
        texts = re.findall(r'<text[^>]*>([^<]*)</text>', txt)
        assert sorted(t for t in texts if t in PRIMITIVES) == sorted(op for op, _ in DARTS_V2.recurrent)
    if fmt == 'png':
        with Image.open(tmp_path/'cell.png') as im: assert im.width > 200 and im.height > 100


@needs_dot
def test_plot_genotype_inline_with_dot():
    img = P.plot_genotype(DARTS_V2)
    assert '<svg' in img._repr_svg_()


@needs_dot
def test_broken_dot_falls_back(monkeypatch, tmp_path):
    fake = tmp_path/'bin'; fake.mkdir()
    (fake/'dot').write_text('#!/bin/sh\necho broken >&2\nexit 3\n'); (fake/'dot').chmod(0o755)
    monkeypatch.setenv('PATH', str(fake))
    with pytest.warns(UserWarning, match='broken'):
        check_file(P.plot_genotype(DARTS_V2, tmp_path/'c.png'), 'png')
    with pytest.raises(RuntimeError, match='broken'): P.plot_genotype(DARTS_V2, tmp_path/'c.png', engine='dot')


# ---------------------------------------------------------------- edge labels: none hidden (#42)

IDENTITY = Genotype([('sigmoid', 0)] + [('identity', 0)] * 7, tuple(range(1, 9)))     # the quick search's typical cell
CROSSED = Genotype([('tanh', 0), ('relu', 0), ('sigmoid', 2), ('identity', 1), ('identity', 3), ('identity', 4), ('relu', 3),
                    ('tanh', 4)], tuple(range(1, 9)))                          # 2->3 crosses 1->4, 3->7 crosses 4->6
IDENTITY_CROSSED = Genotype([('identity', 0)] * 3 + [('identity', 3), ('identity', 2), ('identity', 3), ('identity', 5),
                            ('identity', 5)], tuple(range(1, 9)))
LABELLED = dict(DARTS_V2=DARTS_V2, DARTS_V1=DARTS_V1, ENAS=ENAS, identity=IDENTITY, crossed=CROSSED, identity_crossed=IDENTITY_CROSSED)


def random_cells(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Genotype([(PRIMITIVES[rng.integers(1, len(PRIMITIVES))], int(rng.integers(i))) for i in range(1, 9)], tuple(range(1, 9)))
            for _ in range(n)]


def label_clashes(fig) -> list:
    "What hides an edge label in a drawn cell: another label's box over it, a node under it, an edge able to draw over it"
    from matplotlib.patches import FancyArrowPatch
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text() in PRIMITIVES]
    boxes = [t.get_bbox_patch().get_window_extent() for t in labels]          # the white box, which holds the text's extent
    assert all(b.contains(*t.get_window_extent().min) and b.contains(*t.get_window_extent().max) for t, b in zip(labels, boxes))
    bad = [f"labels {labels[i].get_text()!r} and {labels[j].get_text()!r} overlap"
           for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    nodes = [p for p in ax.patches if not isinstance(p, FancyArrowPatch)]
    bad += [f"label {t.get_text()!r} covers a node" for t, b in zip(labels, boxes) if any(b.overlaps(n.get_window_extent()) for n in nodes)]
    bad += [f"label {t.get_text()!r} can be drawn over" for t in labels
            if t.get_zorder() <= max(a.get_zorder() for a in arrows) or t.get_bbox_patch().get_alpha() not in (None, 1)]
    return bad


@pytest.mark.parametrize('name', LABELLED)
def test_cell_labels_all_visible(no_dot, name):
    "Each edge label of the matplotlib diagram sits clear of every other label and node, above every edge"
    g = LABELLED[name]
    fig = P.plot_genotype(g)
    assert sorted(t.get_text() for t in fig.axes[0].texts if t.get_text() in PRIMITIVES) == sorted(op for op, _ in g.recurrent)
    assert label_clashes(fig) == []


def test_cell_labels_all_visible_random_cells(no_dot):
    "Ten random cells (the ones test_dot_labels_all_visible lays out with graphviz): a placement that ignores the nodes hides labels in five of them"
    for g in random_cells(10):
        assert label_clashes(P.plot_genotype(g)) == [], g


def test_gif_frames_labels_all_visible():
    "genotype_gif draws every epoch at one common size: the labels must fit that size too"
    size = P._cell_size([CROSSED, IDENTITY_CROSSED, DARTS_V2])
    for g in (CROSSED, IDENTITY_CROSSED): assert label_clashes(P._cell_figure(g, 'epoch 1', size=size)) == []


def test_study_selected_cell_labels_all_visible(no_dot, monkeypatch, tmp_path):
    "The study report's selected.png is this diagram (plot_genotype), so its labels are clear too"
    from rnn_darts.study import STUDY_COLUMNS
    drawn, cell_figure = [], P._cell_figure
    monkeypatch.setattr(P, '_cell_figure', lambda *a, **k: drawn.append(cell_figure(*a, **k)) or drawn[-1])
    g = json.dumps(dict(recurrent=[list(x) for x in CROSSED.recurrent], concat=list(CROSSED.concat)))
    row = dict(stage='short-search-first-1', method='first', seed=1, cell='search-first-1', genotype=g, search_seconds=60.0,
               short_valid_loss=2.0, short_valid_ppl=math.exp(2.0), selected=True, final_valid_ppl=math.nan, final_test_ppl=math.nan)
    R.write_study_report(tmp_path, pd.DataFrame([row], columns=list(STUDY_COLUMNS)))
    check_file(tmp_path/'report'/'selected.png', 'png')
    assert len(drawn) == 1 and drawn[0].axes[0].get_title() == 'selected: short-search-first-1'
    assert label_clashes(drawn[0]) == []


def _bezier_points(pts, n=25):
    pts, s = np.asarray(pts, float), np.linspace(0, 1, n)[:, None]
    return np.concatenate([(1-s)**3 * p0 + 3 * (1-s)**2 * s * p1 + 3 * (1-s) * s**2 * p2 + s**3 * p3
                           for p0, p1, p2, p3 in (pts[k:k+4] for k in range(0, len(pts) - 3, 3))])


@needs_dot
@pytest.mark.parametrize('g', [*LABELLED.values(), *random_cells(10)], ids=[*LABELLED, *(f'random{k}' for k in range(10))])
def test_dot_labels_all_visible(g):
    "graphviz's layout (its -Tjson: label positions and widths, edge splines): no label box meets another or another edge"
    j = json.loads(P._run_dot(P.genotype_dot(g, 'selected: a stage'), 'json'))
    labels, curves = [], [np.concatenate([_bezier_points(o['points']) for o in e['_draw_'] if o['op'] == 'b']) for e in j['edges']]
    for k, e in enumerate(j['edges']):
        size = next((o['size'] for o in e.get('_ldraw_', []) if o['op'] == 'F'), None)
        for o in e.get('_ldraw_', []):
            if o['op'] == 'T':
                (x, y), w = o['pt'], o['width']            # pt: the baseline's centre
                labels.append((k, o['text'], (x - w / 2, y - 0.25 * size, x + w / 2, y + 0.8 * size)))
    assert sorted(t for _, t, _ in labels) == sorted(op for op, _ in g.recurrent)
    meet = lambda a, b: a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
    for i, (k, t, a) in enumerate(labels):
        assert not [u for _, u, b in labels[i + 1:] if meet(a, b)], t
        crossing = [c for m, c in enumerate(curves) if m != k and
                    ((c[:, 0] > a[0]) & (c[:, 0] < a[2]) & (c[:, 1] > a[1]) & (c[:, 1] < a[3])).any()]
        assert not crossing, f"an edge runs through the label {t!r}"


# ---------------------------------------------------------------- α

@pytest.mark.parametrize('relax', ['softmax', 'sigmoid'])
def test_plot_alphas_data(relax):
    h = history(5, relax=relax)
    fig = P.plot_alphas(h, epoch=2)
    np.testing.assert_allclose(np.asarray(fig.axes[0].images[0].get_array()), np.asarray(h[2]['weights']))
    np.testing.assert_allclose(fig.alphas, h[2]['weights'])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == P.edge_names(8)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == PRIMITIVES
    # the second panel: each node's winning op at each epoch (nodes x epochs)
    want = np.array([[PRIMITIVES.index(op) for op, _ in e['genotype']['recurrent']] for e in h]).T
    np.testing.assert_array_equal(fig.winners, want)
    np.testing.assert_array_equal(np.asarray(fig.axes[-1].images[0].get_array()), want)
    norm = fig.axes[0].images[0].norm                                  # colours span the weights, not 0–1
    w = np.asarray(h[2]['weights'])
    assert (norm.vmin, norm.vmax) == pytest.approx((w.min(), w.max()))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert f"{w[0, 0]:.3f}" == texts[0] and all(t.get_fontsize() >= 7 for t in fig.axes[0].texts)

def test_plot_alphas_uniform_weights_have_a_range():
    h = history(1)
    h[0]['weights'] = [[0.2] * 5 for _ in h[0]['weights']]
    norm = P.plot_alphas(h).axes[0].images[0].norm
    assert norm.vmin < 0.2 < norm.vmax and norm.vmax - norm.vmin < 0.02


def test_plot_alphas_files(tmp_path):
    h = history(3)
    p = tmp_path/'history.json'; p.write_text(json.dumps(h))
    check_file(P.plot_alphas(p, path=tmp_path/'a.png'), 'png')
    check_file(P.plot_alphas(tmp_path, path=tmp_path/'a.pdf'), 'pdf')        # a run folder works too
    np.testing.assert_allclose(P.alpha_matrix(p), h[-1]['weights'])
    np.testing.assert_allclose(P.alpha_matrix(p, 0), h[0]['weights'])
    with pytest.raises(IndexError, match='epoch 7 is not in the history'): P.plot_alphas(h, 7)
    with pytest.raises(FileNotFoundError, match='nope.json'): P.plot_alphas(tmp_path/'nope.json')


def test_history_without_genotype_derives_it():
    h = history(2)
    for e in h: del e['genotype']
    fig = P.plot_alphas(h)
    want = derive_genotype(np.asarray(h[-1]['weights']))
    np.testing.assert_array_equal(fig.winners[:, -1], [PRIMITIVES.index(op) for op, _ in want.recurrent])


# ---------------------------------------------------------------- GIF

def test_genotype_gif(tmp_path):
    h = history(3)
    out = P.genotype_gif(h, tmp_path/'search.gif', fps=4)
    check_file(out, 'gif')
    with Image.open(out) as im:
        assert im.n_frames == len(h)
        assert im.info.get('duration') == 250
        sizes = set()
        for k in range(im.n_frames): im.seek(k); sizes.add(im.size)
        assert len(sizes) == 1
    with pytest.raises(ValueError, match=r'\.gif'): P.genotype_gif(h, tmp_path/'search.png')


def test_genotype_gif_same_with_or_without_dot(no_dot, tmp_path):
    with Image.open(P.genotype_gif(history(2), tmp_path/'s.gif')) as im: assert im.n_frames == 2


# ---------------------------------------------------------------- learning curves

def test_plot_curves_from_csv(tmp_path):
    d, run = make_run(tmp_path/'run', epochs=5)
    fig = P.plot_curves(d/'log.csv', asgd_epoch=2)
    df = pd.read_csv(d/'log.csv')
    ax, ax2 = fig.axes[:2]
    by_label = {l.get_label(): l for l in ax.lines}
    np.testing.assert_allclose(by_label['train'].get_ydata(), df['train_loss'])
    np.testing.assert_allclose(by_label['valid'].get_ydata(), df['valid_loss'])
    np.testing.assert_allclose(by_label['search (α stream)'].get_ydata(), df['search_loss'])
    np.testing.assert_allclose(ax2.lines[0].get_ydata(), df['perplexity'])
    asgd = [l for l in ax.lines if l.get_label().startswith('NT-ASGD')]
    assert len(asgd) == 1 and list(asgd[0].get_xdata()) == [2, 2]
    for a in (ax, ax2):                                                # whole epochs on the axis
        ticks = [t for t in a.get_xticks() if a.get_xlim()[0] <= t <= a.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert any('without' in t.get_text() and 'dropout' in t.get_text() for t in ax.texts)   # why valid < train
    check_file(P.plot_curves(d/'log.csv', 2, tmp_path/'c.png'), 'png')
    check_file(P.plot_curves(d/'log.csv', None, tmp_path/'c.svg'), 'svg')


def test_plot_curves_dataframe_without_perplexity_or_asgd():
    df = pd.DataFrame(dict(epoch=[0, 1, 2], train_loss=[6., 5., 4.5], valid_loss=[5.5, 5., 4.8], time=['00:01'] * 3))
    fig = P.plot_curves(df)
    np.testing.assert_allclose(fig.axes[1].lines[0].get_ydata(), np.exp(df['valid_loss']))
    assert not any(l.get_label().startswith('NT-ASGD') for l in fig.axes[0].lines)
    assert 'search (α stream)' not in [l.get_label() for l in fig.axes[0].lines]


def test_plot_curves_from_recorder():
    class Rec:   # what fastai's Recorder exposes
        metric_names = ['epoch', 'train_loss', 'valid_loss', 'perplexity', 'time']
        values = [[6.0, 5.5, math.exp(5.5)], [5.0, 5.1, math.exp(5.1)]]
    fig = P.plot_curves(Rec())
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [6.0, 5.0])
    np.testing.assert_allclose(fig.axes[1].lines[0].get_ydata(), np.exp([5.5, 5.1]))
    with pytest.raises(TypeError, match='Recorder'): P.plot_curves(42)


def test_figures_display_as_png_without_pyplot():
    "Jupyter and nbconvert show a returned figure as a picture, not as '<Figure size ...>'"
    formatters = pytest.importorskip('IPython.core.formatters')
    fig = P.plot_curves(pd.DataFrame(dict(epoch=[0, 1], train_loss=[6., 5.], valid_loss=[5.5, 5.])))
    data, _ = formatters.DisplayFormatter().format(fig)
    assert data['image/png'][:8] == b'\x89PNG\r\n\x1a\n'
    with Image.open(io.BytesIO(data['image/png'])) as im: assert im.size[0] > 100


def test_log_with_repeated_header(tmp_path):
    p = tmp_path/'log.csv'
    p.write_text('epoch,train_loss,valid_loss,perplexity,time\n0,6,5.5,244.7,00:02\n'
                 'epoch,train_loss,valid_loss,perplexity,time\n1,5,5.0,148.4,00:02\n')
    df = P.log_frame(p)
    assert list(df['epoch']) == [0, 1] and list(df['valid_loss']) == [5.5, 5.0]


# ---------------------------------------------------------------- curvature

def curvature_run(med, windows):
    log = pd.DataFrame(dict(epoch=range(len(med)), train_loss=5.0, valid_loss=4.0, lambda_max=med))
    g = dict(recurrent=[['tanh', 0]], concat=[1])
    return log, [dict(epoch=e, weights=[[0.2] * 5], genotype=g, lambda_max_windows=w) for e, w in enumerate(windows)]


def median_share(ax) -> float:
    "The share of the axis height that the median line's data spans (in the axis's own scale, log or linear)"
    ax.figure.canvas.draw(); line = ax.lines[0]
    y = ax.transAxes.inverted().transform(ax.transData.transform(np.c_[line.get_xdata(), line.get_ydata()]))[:, 1]
    return y.max() - y.min()


def test_plot_curvature_median_readable_under_a_wide_band():
    "A median near 0.2 with three windows reaching 17 (#42): the median line spans at least a fifth of the plot's height"
    med = [0.16, 0.18, 0.2, 0.22, 0.21, 0.24, 0.19, 0.23]
    windows = [[0.6 * m, m, 1.4 * m] for m in med]
    for e in (2, 4, 6): windows[e] = [0.1, med[e], 17.0]
    log, h = curvature_run(med, windows)
    ax = P.plot_curvature(log, h).axes[0]
    assert list(ax.lines[0].get_ydata()) == med
    assert median_share(ax) >= 0.2, (ax.get_yscale(), ax.get_ylim())
    lo, hi = ax.get_ylim()
    if hi < 17: assert any('17' in t.get_text() for t in ax.get_legend().get_texts())   # a cut band says how far it reaches


def test_plot_curvature_narrow_band_shows_all_of_it():
    "A band close to the median is drawn whole, on a linear axis"
    med = [0.2, 0.3, 0.4, 0.5]
    log, h = curvature_run(med, [[0.8 * m, m, 1.2 * m] for m in med])
    ax = P.plot_curvature(log, h).axes[0]
    assert ax.get_yscale() == 'linear' and ax.get_ylim()[0] <= 0.16 and ax.get_ylim()[1] >= 0.6
    assert median_share(ax) >= 0.2 and not any('reach' in t.get_text() for t in ax.get_legend().get_texts())


def test_plot_curvature_orders_of_magnitude_on_a_log_axis():
    "PTB's λ_max grows by orders of magnitude: a log axis, everything in it"
    med = [0.05, 0.5, 5.0, 50.0]
    log, h = curvature_run(med, [[0.5 * m, m, 2 * m] for m in med])
    ax = P.plot_curvature(log, h).axes[0]
    assert ax.get_yscale() == 'log' and ax.get_ylim()[0] <= 0.025 and ax.get_ylim()[1] >= 100
    assert median_share(ax) >= 0.2


# ---------------------------------------------------------------- random search's candidates

def test_plot_candidates_marks_the_chosen_cell_where_its_legend_says():
    "The chosen cell's line stands at the perplexity its legend prints first, the one the axis measures (screening); the full split's is named"
    cands = pd.DataFrame(dict(rank=[2, 1, 3, 4, 5], screen_ppl=[9.12, 9.38, 9.9, 11.0, np.inf], valid_ppl=[9.01, 8.89, None, None, None]))
    ax = P.plot_candidates(cands).axes[0]
    chosen = [l for l in ax.lines if l.get_label().startswith('chosen')]
    assert len(chosen) == 1 and chosen[0].get_label() in [t.get_text() for t in ax.get_legend().get_texts()]
    label, x = chosen[0].get_label(), chosen[0].get_xdata()[0]
    assert x == pytest.approx(9.38) and float(re.search(r'\d+\.\d+', label).group()) == pytest.approx(x, abs=0.005), label
    assert re.search(r'screening[^\d]*9\.38', label) and 'screening' in ax.get_xlabel()
    assert re.search(r'full validation[^\d]*8\.89', label), label


# ---------------------------------------------------------------- report

def _images(text, fmt):
    return re.findall(r'!\[[^\]]*\]\(([^)]+)\)', text) if fmt == 'md' else re.findall(r'<img src="([^"]+)"', text)


@pytest.mark.parametrize('fmt', ['md', 'html'])
def test_report_search_run(tmp_path, fmt, monkeypatch):
    "The md report draws its pictures and checks each file; the html one (the same drawing code, before the format is read) has them drawn as empty files and checks its text and links"
    d, run = make_run(tmp_path/'run', epochs=4)
    if fmt == 'html':
        for f in ('plot_genotype', 'plot_alphas', 'genotype_gif', 'plot_curves'):
            monkeypatch.setattr(R, f, lambda *a, **k: next(x for x in a if isinstance(x, Path)).write_bytes(b''))
    rep = R.write_report(d, fmt)
    assert rep == d/'report'/f'report.{fmt}'
    text = rep.read_text()
    best = math.exp(run['best_valid_loss'])
    assert f'{best:.2f}' in text
    last_ppl = math.exp(pd.read_csv(d/'log.csv')['valid_loss'].iloc[-1])
    assert f'{last_ppl:.2f}' not in text                              # the best, not the last epoch
    assert 'cpu' in text and ('| mean time per epoch | 1m 06s |' if fmt == 'md' else '<td>mean time per epoch</td><td>1m 06s</td>') in text   # device, mean of epoch_times (66.5 s)
    for k in run['settings']: assert k in text
    imgs = _images(text, fmt)
    assert set(imgs) == {'genotype.png', 'alphas_first.png', 'alphas.png', 'search.gif', 'curves.png'}
    for f in imgs: assert (rep.parent/f).is_file(), f
    if fmt == 'md':
        for f in imgs: check_file(rep.parent/f, 'gif' if f.endswith('.gif') else 'png')
        with Image.open(rep.parent/'search.gif') as im: assert im.n_frames == 4
    g = run['genotype']['recurrent']
    assert ', '.join(f'{op}({p})' for op, p in g) in text
    assert 'validation can sit below training' in text
    if fmt == 'md': assert 'ptb\\|small' in text                       # pipes escaped in the table
    else: assert text.startswith('<!DOCTYPE html>') and '</html>' in text


def test_report_train_run_without_dot(no_dot, tmp_path):
    d, run = make_run(tmp_path/'run', command='train', epochs=3, asgd_epoch=None)
    r = json.loads((d/'run.json').read_text()); r.update(test_loss=4.5678, test_ppl=math.exp(4.5678))
    (d/'run.json').write_text(json.dumps(r))                           # what `rnn-darts train` adds at its end
    text = R.write_report(d).read_text()
    assert '| test loss | 4.5678 |' in text and f'| test perplexity | {math.exp(4.5678):.2f} |' in text
    assert f"{math.exp(run['best_valid_loss']):.2f}" in text
    assert 'NVIDIA H100 80GB HBM3' in text and 'never' in text
    assert set(_images(text, 'md')) == {'genotype.png', 'curves.png'}
    assert not (d/'report'/'search.gif').exists()


def test_report_falls_back_to_log(tmp_path):
    d, run = make_run(tmp_path/'run', command='train', epochs=3)
    r = json.loads((d/'run.json').read_text()); del r['best_valid_loss'], r['epoch_times'], r['command'], r['settings']   # a run.json from elsewhere
    (d/'run.json').write_text(json.dumps(r))
    s = R.run_summary(d)
    assert (s['command'], s['settings']) == ('?', {})
    assert R.search_comparison(tmp_path) == []   # a folder beside searches with such a record is no search: left out, not an error
    assert s['best_valid_loss'] == pytest.approx(pd.read_csv(d/'log.csv')['valid_loss'].min())
    assert s['mean_epoch_time'] == pytest.approx(65.0)                # from the log's 'mm:ss' column
    assert f"{s['best_perplexity']:.2f}" in R.write_report(d).read_text()


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path/'missing'))): R.write_report(tmp_path/'missing')
    (tmp_path/'empty').mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path/'empty'/'run.json'))): R.write_report(tmp_path/'empty')
    (tmp_path/'empty'/'run.json').write_text('{"command": ')
    with pytest.raises(ValueError, match='run.json.*not valid JSON'): R.write_report(tmp_path/'empty')
    d, _ = make_run(tmp_path/'run')
    with pytest.raises(ValueError, match="'md' or 'html'"): R.write_report(d, 'pdf')
