"""Embeddings and output heads are found by the model's structure, not by their names (issue 30): on models this
project did not write, each rule is checked, and the start-up plan names the largest tensor of each step."""

from __future__ import annotations

import torch
from lightning.pytorch.demos import Transformer
from torch import nn

from lightning_lordo import LoRDO
from lightning_lordo.convert import compile_patterns, full_rank_params, output_heads
from lightning_lordo.optim.report import plan_summary


def _plan(model: nn.Module, patterns: tuple[str, ...] = ()) -> dict[str, str]:
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: why for p, why in full_rank_params(model, compile_patterns(patterns)).items()}


class GPT2Style(nn.Module):
    """GPT-2's layout: token and position embeddings, blocks, a final norm, an untied ``lm_head``."""

    def __init__(self, vocab: int = 300, d: int = 32, tied: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.h = nn.ModuleList(nn.ModuleDict({"c_attn": nn.Linear(d, 3 * d), "c_proj": nn.Linear(d, d),
                                              "c_fc": nn.Linear(d, 4 * d), "mlp_proj": nn.Linear(4 * d, d)})
                               for _ in range(2))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.dropout = nn.Dropout(0.1)
        self.species = nn.Linear(64, 10)
        self.size = nn.Linear(64, 3)


class Classifier(nn.Module):
    """A CNN whose head is called ``fc``, after a parameterless pooling layer."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.hidden = nn.Linear(32, 64)
        self.fc = nn.Linear(64, 10)


def test_lightning_demo_transformer_keeps_its_decoder_and_embedding_full_rank():
    model = Transformer(vocab_size=500, ninp=32, nhead=2, nhid=32, nlayers=2)
    plan = _plan(model)
    assert set(plan) == {"embedding.weight", "decoder.weight"}
    assert plan["decoder.weight"].startswith("output head")


def test_gpt2_style_lm_head_and_both_embeddings():
    plan = _plan(GPT2Style())
    assert set(plan) == {"wte.weight", "wpe.weight", "lm_head.weight"}


def test_tied_head_is_the_embedding():
    model = GPT2Style(tied=True)
    assert model.lm_head.weight is model.wte.weight
    plan = _plan(model)
    assert set(plan) == {"wte.weight", "wpe.weight"}  # one tensor, named once by named_parameters
    opt = LoRDO(model.parameters(), rank=4, full_rank=full_rank_params(model))
    assert all(row["step"] == "adamw" for row in opt.describe() if row["shape"] == (300, 32))


def test_classifier_head_named_fc_after_a_pooling_layer():
    model = Classifier()
    plan = _plan(model)
    assert set(plan) == {"fc.weight"}  # the hidden layer before it stays low-rank
    assert [type(m) for m in output_heads(model)] == [nn.Linear]


def test_two_heads_both_full_rank_and_the_trunk_low_rank():
    plan = _plan(TwoHeads())
    assert set(plan) == {"species.weight", "size.weight"}


def test_a_head_in_a_sequential_is_found_and_a_hidden_layer_is_not():
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4), nn.LogSoftmax(-1))
    assert set(_plan(mlp)) == {"4.weight"}


def test_a_model_ending_in_a_norm_has_no_linear_head():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    assert _plan(model) == {}


def test_user_patterns_add_to_the_structure():
    plan = _plan(TwoHeads(), (r"trunk\.0\.weight$",))
    assert set(plan) == {"species.weight", "size.weight", "trunk.0.weight"}
    assert plan["trunk.0.weight"] == "named in full_rank_params"


def test_plan_summary_names_the_largest_tensor_of_each_step():
    model = Transformer(vocab_size=500, ninp=32, nhead=2, nhid=32, nlayers=2)
    names = {p: n for n, p in model.named_parameters()}
    opt = LoRDO(model.parameters(), rank=4, full_rank=full_rank_params(model))
    low, adamw = plan_summary(opt.describe(names))
    assert "take the low-rank step" in low and "rank 4" in low
    assert "take AdamW" in adamw and ("decoder.weight" in adamw or "embedding.weight" in adamw)
    assert "500 x 32" in adamw


def test_no_full_rank_reason_without_strategy_is_plain():
    lin = nn.Linear(8, 8)
    opt = LoRDO([lin.weight], rank=2, full_rank=[lin.weight])
    assert opt.describe()[0]["reason"] == "listed in full_rank"
    torch.manual_seed(0)


def test_a_position_table_as_wide_as_the_model_makes_no_projection_a_head():
    """65 characters, 128 positions, 128 wide: the 128-wide projections read and write the model's width, so only the
    embeddings and the real head are full-rank (every attention and MLP matrix takes the low-rank step)."""
    from lightning_lordo.models import CharGPT

    model = CharGPT(vocab_size=65, d_model=128, n_layers=2, n_heads=4, seq_len=128, tie_weights=False)
    plan = _plan(model)
    assert set(plan) == {"tok_emb.weight", "pos_emb.weight", "head.weight"}, sorted(plan)


def test_a_vocabulary_sized_head_is_found_wherever_it_is_registered():
    class HeadFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(32, 300, bias=False)  # registered before the blocks
            self.wte, self.wpe = nn.Embedding(300, 32), nn.Embedding(32, 32)
            self.blocks = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))

    plan = _plan(HeadFirst())
    assert plan["lm_head.weight"].startswith("output head (out_features = the token")
    assert "blocks.0.weight" not in plan


def test_a_weight_normed_head_keeps_the_parameters_behind_its_weight_full_rank():
    """Under ``weight_norm`` (DINO's last layer) ``head.weight`` is computed; the parameters the optimizer holds are
    those behind it, in either of torch's forms (they took the low-rank step)."""
    from torch.nn.utils import parametrizations

    new = nn.Sequential(nn.Linear(16, 64), nn.GELU(), parametrizations.weight_norm(nn.Linear(64, 100)))
    plan = _plan(new)
    assert {"2.parametrizations.weight.original0", "2.parametrizations.weight.original1"} <= set(plan), plan
    assert "0.weight" not in plan
    import warnings

    with warnings.catch_warnings():  # torch deprecates the older form
        warnings.simplefilter("ignore")
        old = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.utils.weight_norm(nn.Linear(64, 100)))
    assert {"2.weight_g", "2.weight_v"} <= set(_plan(old)), _plan(old)


class WithTeacher(nn.Module):
    """A student and, registered after it, a frozen copy (distillation, BYOL, DINO): the head is the student's."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 100))
        self.teacher = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 100)).requires_grad_(False)


def test_a_frozen_module_registered_last_is_passed_over_for_the_head():
    assert set(_plan(WithTeacher())) == {"student.2.weight"}


def test_complex_parameters_are_refused_by_name_not_trained_as_real():
    """LoRDO's state is real: a step dropped the imaginary part (torch's AdamW trains it)."""
    import pytest

    from lightning_lordo.convert import convert_optimizer

    model = nn.Linear(8, 8).to(torch.complex64)
    names = {p: n for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"\['weight', 'bias'\] are complex.*torch.view_as_real"):
        convert_optimizer(torch.optim.AdamW(model.parameters()), {}, {}, 0, names)
    opt = LoRDO(model.parameters(), rank=2)
    model(torch.randn(4, 8, dtype=torch.complex64)).abs().sum().backward()
    with pytest.raises(RuntimeError, match="nor complex parameters"):
        opt.step()


def test_a_frozen_output_layer_makes_no_hidden_layer_a_head():
    """A fixed classifier (frozen last layer): the trainable layer before it is hidden, and stays low-rank."""
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    model[4].requires_grad_(False)
    assert _plan(model) == {}
