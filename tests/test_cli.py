"The command line end to end on tiny settings: flags reach the learners (bf16, fused loss), run folders are written."
import json
import pytest, torch
from rnn_darts import cli
from callbacks.training import BF16Autocast, FusedDecoderLoss

TINY = ['--data', 'numbers', '--n-train', '3000', '--epochs', '1', '--bs', '8', '--bptt', '10', '--eval-bs', '4',
        '--emsize', '8', '--nhid', '8', '--device', 'cpu']

def test_search_with_bf16_flags(tmp_path):
    learn = cli.run_command(['search', *TINY, '--mode', 'first', '--bf16', 'true', '--out', str(tmp_path/'s')])
    assert any(isinstance(cb, BF16Autocast) for cb in learn.cbs) and not learn.arch_param_update.arch_bf16
    assert any(isinstance(cb, FusedDecoderLoss) for cb in learn.cbs) and learn.model.fused_loss
    assert json.loads((tmp_path/'s'/'run.json').read_text())['settings']['bf16'] is True
    assert (tmp_path/'s'/'genotype.json').exists() and learn.model.flat.data.dtype == torch.float32

def test_train_with_plain_loss_from_a_preset(tmp_path):
    ini = tmp_path/'settings.ini'
    ini.write_text('[plain]\nfused_loss = false\narch_bf16 = false\n')
    learn = cli.run_command(['train', *TINY, '--settings', str(ini), '--preset', 'plain', '--out', str(tmp_path/'t')])
    assert not learn.model.fused_loss and not any(isinstance(cb, FusedDecoderLoss) for cb in learn.cbs)
    assert not any(isinstance(cb, BF16Autocast) for cb in learn.cbs)
    assert (tmp_path/'t'/'log.csv').exists()

def test_unknown_command_prints_usage(capsys):
    with pytest.raises(SystemExit) as e: cli.run_command(['serach'])
    assert e.value.code == 2 and 'usage: rnn-darts {search,train,evaluate,bench,report}' in capsys.readouterr().out
