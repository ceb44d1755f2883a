"Tests of rnn_darts.data: corpora, PTB download, batchify, StreamDL, SearchStream, builders"
import hashlib, threading, functools, http.server
from pathlib import Path
import numpy as np, pytest, torch
from torch import nn
from rnn_darts import data as D
from rnn_darts.data import (Corpus, read_corpus, write_corpus, numbers_corpus, number_words, get_ptb, PTB_HASHES,
                            batchify, StreamDL, SearchStream, lm_dls, search_stream, EOS, NUMBER_WORDS)
from tests._learners import corpus_folder

PENN = Path(__file__).resolve().parents[1].parent/'shared'/'data'/'penn'
needs_penn = pytest.mark.skipif(not (PENN/'valid.txt').exists() or not (PENN/'test.txt').exists(),
                                reason=f"the PTB valid/test files are not at {PENN}")

def mkcorpus(d, train=" the cat sat \n the dog \n", valid=" the cat \n", test=" a dog \n"):
    "A corpus folder of a few words"
    return Path(corpus_folder(d, train, valid, test))

def words(c, split): return [c.vocab[i] for i in getattr(c, split).tolist()]

# ---------------------------------------------------------------- read_corpus

def test_read_corpus_vocab_order_and_eos(tmp_path):
    c = read_corpus(mkcorpus(tmp_path, train="b a\n\na c b\n", valid="a\n", test="c\n"))
    assert c.vocab == ['b', 'a', EOS, 'c']
    assert c.stoi == {w: i for i, w in enumerate(c.vocab)}
    assert words(c, 'train') == ['b', 'a', EOS, EOS, 'a', 'c', 'b', EOS]  # empty lines give <eos> too
    assert c.train.dtype == torch.long and c.train.dim() == 1
    assert 'train 8 tokens' in repr(c) and str(tmp_path) in repr(c)

def test_read_corpus_oov_error_names_file_line_word(tmp_path):
    d = mkcorpus(tmp_path, test=" the dog \n the zebra \n")
    with pytest.raises(KeyError, match=r"test\.txt: line 2: word 'zebra'"): read_corpus(d)

def test_read_corpus_unk_added_or_reused(tmp_path):
    c = read_corpus(mkcorpus(tmp_path/'a', test=" a dog \n"), unk='<unk>')
    assert c.vocab[-1] == '<unk>' and words(c, 'test') == ['<unk>', 'dog', EOS]
    c = read_corpus(mkcorpus(tmp_path/'b', train=" <unk> the \n", valid=" the \n", test=" mouse \n"), unk='<unk>')
    assert c.vocab == ['<unk>', 'the', EOS] and c.test.tolist() == [0, 2]

def test_read_corpus_files_mapping(tmp_path):
    d = mkcorpus(tmp_path)
    c = read_corpus(d, files=dict(train='valid.txt', valid='valid.txt', test='valid.txt'))
    assert words(c, 'train') == ['the', 'cat', EOS] and c.files['test'] == 'valid.txt'
    with pytest.raises(ValueError, match='unknown split'): read_corpus(d, files=dict(dev='valid.txt'))

def test_read_corpus_errors_name_path(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope does not exist'): read_corpus(tmp_path/'nope')
    (tmp_path/'afile').write_text('x')
    with pytest.raises(NotADirectoryError, match='afile is not a directory'): read_corpus(tmp_path/'afile')
    d = mkcorpus(tmp_path/'c'); (d/'valid.txt').unlink()
    with pytest.raises(FileNotFoundError, match=r'valid\.txt: the valid split file does not exist \(test\.txt, train\.txt are there\); --files names the train'): read_corpus(d)
    d = mkcorpus(tmp_path/'e', test=" \n\n")
    with pytest.raises(ValueError, match=r'test\.txt: the test split is empty'): read_corpus(d)
    d = mkcorpus(tmp_path/'u', train=" ok \n caf\xe9 \n".encode('latin-1'))
    with pytest.raises(ValueError, match=r'train\.txt: not valid UTF-8 at byte offset 9 \(line 2\)'): read_corpus(d)

def test_write_corpus_roundtrip(tmp_path):
    c = numbers_corpus(seed=3, n_train=500, n_valid=100, n_test=100)
    c2 = read_corpus(write_corpus(c, tmp_path/'out'))
    for s in D.SPLITS: assert words(c2, s) == words(c, s)
    assert sorted(c2.vocab) == sorted(c.vocab)

@needs_penn
def test_read_real_ptb_counts():
    c = read_corpus(PENN, files=dict(train='valid.txt', valid='test.txt', test='test.txt'), unk='<unk>')
    assert len(c.train) == 73_760 and len(c.valid) == len(c.test) == 82_430
    assert 5_000 < len(c.vocab) <= 10_000 and '<unk>' in c.stoi and 'N' in c.stoi
    assert (c.valid == c.stoi['<unk>']).sum() > (c.train == c.stoi['<unk>']).sum() / 10
    assert D.file_hash_ok(PENN/'valid.txt', PTB_HASHES['valid']) and D.file_hash_ok(PENN/'test.txt', PTB_HASHES['test'])

# ---------------------------------------------------------------- numbers corpus

def _num(ws):
    "Parse English number words back to an int"
    n = 0
    for w in ws:
        if w == 'hundred': n *= 100
        elif w in D._TENS: n += 10 * (D._TENS.index(w) + 2)
        else: n += D._ONES.index(w)
    return n

def test_number_words_roundtrip():
    assert all(_num(number_words(i)) == i for i in range(1000))
    assert number_words(115) == ['one', 'hundred', 'fifteen']

def test_numbers_corpus_deterministic_and_sized():
    a, b, c = numbers_corpus(seed=1), numbers_corpus(seed=1), numbers_corpus(seed=2)
    for s in D.SPLITS: assert torch.equal(getattr(a, s), getattr(b, s))
    assert not torch.equal(a.train[:1000], c.train[:1000])
    assert 200_000 <= len(a.train) < 200_050 and 20_000 <= len(a.valid) < 20_050 and 20_000 <= len(a.test) < 20_050
    assert a.vocab == NUMBER_WORDS and a.train.max() < len(a.vocab)
    assert not torch.equal(a.valid[:500], a.test[:500])
    with pytest.raises(ValueError, match='n_valid'): numbers_corpus(n_valid=0)

def test_numbers_corpus_structure():
    c = numbers_corpus(seed=0, n_train=20_000, n_valid=10, n_test=10)
    sents = ' '.join(words(c, 'train')).split(f' {EOS}')
    kinds = dict(plus=0, minus=0, times=0)
    for s in sents:
        ws = s.split()
        if not ws: continue
        for op, f in dict(plus=lambda a, b: a + b, minus=lambda a, b: a - b, times=lambda a, b: a * b).items():
            if op in ws:
                i, j = ws.index(op), ws.index('is')
                assert f(_num(ws[:i]), _num(ws[i+1:j])) == _num(ws[j+1:]), s
                kinds[op] += 1
    assert all(v > 100 for v in kinds.values()), kinds

# ---------------------------------------------------------------- get_ptb

class _Quiet(http.server.SimpleHTTPRequestHandler):
    requests = []
    def log_message(self, *a): pass
    def do_GET(self):
        _Quiet.requests.append(self.path); return super().do_GET()

@pytest.fixture
def server(tmp_path):
    "A local HTTP server on 127.0.0.1 serving tmp_path/'srv'; yields (base url, folder)"
    srv = tmp_path/'srv'; srv.mkdir()
    _Quiet.requests = []
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(_Quiet, directory=str(srv)))
    t = threading.Thread(target=httpd.serve_forever, daemon=True); t.start()
    yield f'http://127.0.0.1:{httpd.server_address[1]}', srv
    httpd.shutdown(); httpd.server_close()

def _serve(srv, texts):
    "Write fixture files ptb.{split}.txt; return their sha256 table"
    res = {}
    for s, t in texts.items():
        (srv/f'ptb.{s}.txt').write_bytes(t)
        res[s] = 'sha256:' + hashlib.sha256(t).hexdigest()
    return res

TEXTS = dict(train=b" the cat sat \n", valid=b" the cat \n", test=b" the \n")

def test_get_ptb_downloads_and_keeps_good_files(server, tmp_path):
    url, srv = server
    hashes = _serve(srv, TEXTS)
    dest = get_ptb(tmp_path/'penn', url=url, hashes=hashes)
    for s in D.SPLITS: assert (dest/f'{s}.txt').read_bytes() == TEXTS[s]
    assert read_corpus(dest).vocab == ['the', 'cat', 'sat', EOS]
    n = len(_Quiet.requests)
    get_ptb(tmp_path/'penn', url=url, hashes=hashes)
    assert len(_Quiet.requests) == n  # verified files are not downloaded again
    get_ptb(tmp_path/'penn', url=url, hashes=hashes, force=True)
    assert len(_Quiet.requests) == n + 3
    assert sorted(p.name for p in dest.iterdir()) == ['test.txt', 'train.txt', 'valid.txt']

def test_get_ptb_replaces_corrupt_file(server, tmp_path):
    url, srv = server
    hashes = _serve(srv, TEXTS)
    dest = tmp_path/'penn'; dest.mkdir()
    (dest/'valid.txt').write_bytes(TEXTS['valid'][:-3])  # a partial file
    get_ptb(dest, url=url, hashes=hashes)
    assert (dest/'valid.txt').read_bytes() == TEXTS['valid']
    assert '/ptb.valid.txt' in _Quiet.requests

def test_get_ptb_wrong_bytes_leave_nothing(server, tmp_path):
    url, srv = server
    hashes = _serve(srv, TEXTS)
    (srv/'ptb.train.txt').write_bytes(b" tampered \n")
    dest = tmp_path/'penn'
    with pytest.raises(ValueError, match=r'ptb\.train\.txt has the wrong content.*nothing was written to .*train\.txt'):
        get_ptb(dest, url=url, hashes=hashes)
    assert list(dest.iterdir()) == []  # no train.txt, no temporary file

def test_get_ptb_unreachable_and_bad_table(tmp_path):
    with pytest.raises(ConnectionError, match=r"could not download Penn Treebank's train split from http://127\.0\.0\.1:9/ptb\.train\.txt"):
        get_ptb(tmp_path/'p', url='http://127.0.0.1:9', hashes=dict(train='sha256:00', valid='sha256:00', test='sha256:00'), timeout=2)
    assert list((tmp_path/'p').iterdir()) == []
    with pytest.raises(ValueError, match=r"no hash for split\(s\) \['test'\]"):
        get_ptb(tmp_path/'p', hashes=dict(train='sha256:00', valid='sha256:00'))
    with pytest.raises(ValueError, match="the train entry must be 'algorithm:hexdigest'"):
        get_ptb(tmp_path/'p', hashes=dict(train='00', valid='sha256:00', test='sha256:00'))

def test_ptb_hash_table_is_explicit():
    assert set(PTB_HASHES) == set(D.SPLITS)
    assert all(v.split(':')[0] in ('sha256', 'md5') for v in PTB_HASHES.values())

# ---------------------------------------------------------------- batchify

def test_batchify_rows_contiguous():
    ids = torch.arange(103)
    b = batchify(ids, 4)
    assert b.shape == (4, 25)
    for k in range(4): assert torch.equal(b[k], ids[k*25:(k+1)*25])

def test_batchify_errors():
    with pytest.raises(ValueError, match=r'data/valid\.txt: 7 tokens are too few for batch size 4'):
        batchify(torch.arange(7), 4, where='data/valid.txt')
    with pytest.raises(ValueError, match='bs must be a positive integer'): batchify(torch.arange(7), 0)
    with pytest.raises(ValueError, match='1-D'): batchify(torch.zeros(3, 3), 1)

# ---------------------------------------------------------------- StreamDL

def _epoch(dl): return [(x.clone(), y.clone()) for x, y in dl]

@pytest.mark.parametrize('policy', ['fixed', 'search', 'train'])
def test_streamdl_contiguous_and_len_exact(policy):
    ids = torch.randint(0, 1000, (3 * 400 + 2,))
    dl = StreamDL(ids, bs=3, bptt=12, policy=policy, seed=0)
    n = len(dl)
    assert len(dl) == n  # stable within the epoch
    batches = _epoch(dl)
    assert len(batches) == n
    xs = torch.cat([x for x, _ in batches], 1); ys = torch.cat([y for _, y in batches], 1)
    stream = batchify(ids, 3)
    assert torch.equal(xs, stream[:, :-1]) and torch.equal(ys, stream[:, 1:])
    for x, y in batches: assert x.shape == y.shape and x.shape[0] == 3 and torch.equal(x[:, 1:], y[:, :-1])
    if policy == 'fixed':
        assert [x.shape[1] for x, _ in batches] == [12] * 33 + [3]

def test_streamdl_search_policy_statistics():
    dl = StreamDL(torch.arange(1000), bs=2, bptt=35, policy='search', seed=1)
    d = np.array([dl.draw_seq_len() for _ in range(20_000)])
    assert set(d.tolist()) == {35, 17}
    assert abs((d == 35).mean() - 0.95) < 0.01

def test_streamdl_train_policy_statistics():
    dl = StreamDL(torch.arange(1000), bs=2, bptt=35, policy='train', seed=1, max_delta=5)
    d = np.array([dl.draw_seq_len() for _ in range(20_000)])
    assert d.min() >= 5 and d.max() == 40 and abs(d.mean() - 34) < 1  # int() truncates: mean ~ bptt - 0.5 minus the clip
    dl = StreamDL(torch.arange(1000), bs=2, bptt=6, policy='train', seed=1)
    d = np.array([dl.draw_seq_len() for _ in range(2000)])
    assert d.min() == 5 and d.max() <= 26

def test_streamdl_own_rng_and_seed_determinism():
    np.random.seed(0); torch.manual_seed(0)
    g, t = np.random.get_state(), torch.get_rng_state()
    a = StreamDL(torch.arange(5000), bs=4, bptt=20, policy='train', seed=7)
    b = StreamDL(torch.arange(5000), bs=4, bptt=20, policy='train', seed=7)
    c = StreamDL(torch.arange(5000), bs=4, bptt=20, policy='train', seed=8)
    for _ in range(2):
        sa, sb, sc = [[x.shape[1] for x, _ in dl] for dl in (a, b, c)]
        assert sa == sb and sa != sc
    assert np.random.get_state()[1].tolist() == g[1].tolist() and torch.equal(torch.get_rng_state(), t)

def test_streamdl_new_schedule_each_epoch():
    dl = StreamDL(torch.arange(5000), bs=4, bptt=20, policy='train', seed=0)
    e1 = [x.shape[1] for x, _ in dl]; e2 = [x.shape[1] for x, _ in dl]
    assert e1 != e2

def test_streamdl_state_dict_resume():
    a = StreamDL(torch.arange(5000), bs=4, bptt=20, policy='search', seed=3)
    _epoch(a)
    len(a)  # the next epoch's schedule is drawn: it is part of the state
    sd = a.state_dict()
    b = StreamDL(torch.arange(5000), bs=4, bptt=20, policy='search', seed=99).load_state_dict(sd)
    for _ in range(3):
        ea, eb = _epoch(a), _epoch(b)
        assert [x.shape for x, _ in ea] == [x.shape for x, _ in eb]
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(ea, eb))

def test_streamdl_accepts_batchified_and_exposes_bptt():
    s = batchify(torch.arange(100), 5)
    dl = StreamDL(s, bs=5, bptt=4)
    assert dl.bptt == 4 and dl.bs == 5 and len(dl) == 5  # 19 targets per row: 4+4+4+4+3
    with pytest.raises(ValueError, match=r'bs=4'): StreamDL(s, bs=4, bptt=4)

def test_streamdl_bad_args():
    ids = torch.arange(100)
    with pytest.raises(ValueError, match='bptt'): StreamDL(ids, bs=2, bptt=1)
    with pytest.raises(ValueError, match='bs'): StreamDL(ids, bs=0, bptt=4)
    with pytest.raises(ValueError, match='policy'): StreamDL(ids, bs=2, bptt=4, policy='nope')
    with pytest.raises(ValueError, match='max_delta'): StreamDL(ids, bs=2, bptt=4, max_delta=-1)
    with pytest.raises(ValueError, match=r'my/train\.txt: 100 tokens are too few for batch size 80'):
        StreamDL(ids, bs=80, bptt=4, where='my/train.txt')

def test_streamdl_device():
    dl = StreamDL(torch.arange(100), bs=2, bptt=4, device='cpu')
    assert dl.device == torch.device('cpu') and dl.data.device.type == 'cpu'
    dl.to(torch.device('cpu'))
    x, y = dl.one_batch()
    assert x.device.type == 'cpu' and x.data_ptr() != 0
    assert x.untyped_storage().data_ptr() == dl.data.untyped_storage().data_ptr()  # batches are views of the stream

@pytest.mark.gpu
def test_streamdl_cuda():
    dls = lm_dls(numbers_corpus(n_train=2000, n_valid=500, n_test=500), 4, 8).to('cuda')
    assert dls.train.data.is_cuda and dls.train.one_batch()[0].is_cuda

# ---------------------------------------------------------------- SearchStream

def test_search_stream_continues_and_wraps():
    ids = torch.arange(2 * 30)
    ss = SearchStream(ids, bs=2)  # rows of 30
    seen = []
    for sl in (10, 10, 9):
        x, y = ss.next(sl)
        assert x.shape == (2, sl) and torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[1], ids[30:60][x[1, 0] - 30 + 1:][:sl])
        seen.append(x[0])
    assert torch.equal(torch.cat(seen), torch.arange(29)) and ss.pos == 29 and ss.wrapped == 0
    x, y = ss.next(5)  # only 0 targets left: wraps before giving a short slice
    assert torch.equal(x[0], torch.arange(5)) and ss.wrapped == 1 and ss.pos == 5

def test_search_stream_never_short():
    ss = SearchStream(torch.arange(60), bs=2)  # rows of 30: 29 targets
    ss.next(10); ss.next(10)
    x, y = ss.next(10)  # 20 + 10 would need a 31st token for the last target: wraps instead
    assert y.shape == x.shape == (2, 10) and ss.wrapped == 1 and torch.equal(x[0], torch.arange(10))
    ss = SearchStream(torch.arange(60), bs=2)
    ss.next(10); ss.next(10); x, y = ss.next(9)  # exactly fits
    assert ss.wrapped == 0 and torch.equal(y[0], torch.arange(21, 30))

def test_search_stream_state_dict_and_errors():
    ss = SearchStream(torch.arange(100), bs=2)
    ss.next(7); ss.next(30); ss.next(30)
    t = SearchStream(torch.arange(100), bs=2).load_state_dict(ss.state_dict())
    for _ in range(4): assert torch.equal(ss.next(11)[0], t.next(11)[0])
    assert t.wrapped == ss.wrapped >= 1
    with pytest.raises(ValueError, match='seq_len 50 is too long'): ss.next(50)
    with pytest.raises(ValueError, match='seq_len'): ss.next(0)

# ---------------------------------------------------------------- builders and fastai

def test_lm_dls_builders(tmp_path):
    c = numbers_corpus(n_train=3000, n_valid=600, n_test=400)
    dls = lm_dls(c, bs=4, bptt=10, phase='train', eval_bs=3, seed=5)
    assert dls.train.policy == 'train' and dls.valid.policy == 'fixed' and dls.valid.bs == 3
    assert lm_dls(c, 4, 10).train.policy == 'search'
    ss = search_stream(c, bs=4)
    assert ss.bs == 4 and torch.equal(ss.data, batchify(c.valid, 4))
    t = D.test_dl(c, 10)
    assert t.bs == 1 and torch.equal(t.data[0], c.test[:len(c.test)])
    with pytest.raises(ValueError, match='phase'): lm_dls(c, 4, 10, phase='eval')
    with pytest.raises(ValueError, match='eval_bs'): lm_dls(c, 4, 10, eval_bs=0)
    with pytest.raises(ValueError, match='bptt'): D.test_dl(c, 1)
    f = read_corpus(mkcorpus(tmp_path, valid=" the \n"), unk='<unk>')
    with pytest.raises(ValueError, match=r'valid\.txt: 2 tokens are too few for batch size 10'): lm_dls(f, 1, 2)

def test_fastai_learner_fit_validate_get_preds():
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.callback.core import Callback
    import fastai.callback.progress  # noqa: F401 (Learner.no_bar)
    torch.manual_seed(0)
    c = numbers_corpus(n_train=6000, n_valid=1200, n_test=600)
    V = len(c.vocab)
    model = nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, V))
    learn = Learner(lm_dls(c, bs=8, bptt=16, phase='train', eval_bs=4), model, loss_func=CrossEntropyLossFlat())
    before = learn.validate()[0]
    class Seen(Callback):
        def before_fit(self): self.sls, self.n_iters = [], []
        def before_batch(self):
            if self.training: self.sls.append(self.x.shape[1]); self.n_iters.append(self.n_iter)
    seen = Seen()
    learn.fit(1, 1e-2, cbs=seen)  # with the progress bar: it needs an exact len()
    assert len(seen.sls) == seen.n_iters[0] == len(learn.recorder.losses) and len(set(seen.sls)) > 1
    assert abs(learn.pct_train - 1) < 1e-9 and len(learn.recorder.values) == 1
    after = learn.validate()[0]
    assert after < before and after < np.log(V)
    with learn.no_bar(): p, t = learn.get_preds(dl=D.test_dl(c, 16, bs=2), concat_dim=1)
    assert p.shape == (2, len(c.test)//2 - 1, V) and torch.equal(t, batchify(c.test, 2)[:, 1:])
    assert torch.allclose(p.sum(-1), torch.ones(()))

# ---------------------------------------------------------------- byte-order marks, NUL bytes, symbolic links

def test_byte_order_marks_are_dropped(tmp_path):
    "An editor's UTF-8 byte-order mark (U+FEFF) at the start of a file, or anywhere, never becomes part of a word"
    c = read_corpus(mkcorpus(tmp_path, train="\ufeff the cat sat \n the \ufeffdog \n", valid="\ufeff the cat \n", test=" the dog \n"))
    assert c.vocab == ['the', 'cat', 'sat', EOS, 'dog'] and words(c, 'valid') == ['the', 'cat', EOS]

def test_nul_bytes_name_the_file_and_line(tmp_path):
    d = mkcorpus(tmp_path, test=b" the cat \n the \x00 \n")
    with pytest.raises(ValueError, match=r"test\.txt: line 2: a NUL byte at byte offset 15"): read_corpus(d)

def test_symbolic_link_loops(tmp_path):
    (tmp_path/'loop').symlink_to(tmp_path/'loop')
    with pytest.raises(FileNotFoundError, match=r"corpus folder .*loop is a broken symbolic link or a symbolic link loop"):
        read_corpus(tmp_path/'loop')
    d = mkcorpus(tmp_path/'c'); (d/'valid.txt').unlink(); (d/'valid.txt').symlink_to(d/'nowhere.txt')
    with pytest.raises(FileNotFoundError, match=r"valid\.txt is a broken symbolic link or a symbolic link loop"): read_corpus(d)
