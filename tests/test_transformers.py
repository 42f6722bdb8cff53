"""Hugging Face transformers through the engine (issue 13): the grouped executor against each client's own forward
and backward, three rounds of the engine against the plain sequential per-client loop (nn.Module, torch.optim.Adam,
state_dict averaging) for the methods of FedGKD's NLP table, tokenisation and its cache, and bad input.

Everything is built locally: a tiny randomly initialised DistilBERT (or BERT) config and a WordLevel tokenizer
trained on the test's own sentences (text_helpers); nothing is downloaded."""

import copy
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import text_helpers as th  # noqa: E402
from sequential_loop import sequential  # noqa: E402

import fedfast  # noqa: E402
from fedfast import data, grouped  # noqa: E402
from fedfast.data import text  # noqa: E402
from fedfast.models import hf  # noqa: E402

# The key projection's bias adds the same amount to every score of a query, which the softmax cancels: its gradient
# is zero up to rounding, and Adam (dividing by sqrt(v)) turns that rounding noise into arbitrary updates in both
# the engine and the loop. The comparisons leave these entries out.
UNIDENTIFIABLE = ("k_lin.bias", "attention.self.key.bias")


@pytest.fixture(scope="module")
def task():
    texts, y = th.sentences(240, 4, seed=0)
    tok = th.tokenizer(texts)
    train = text.tokenize(texts[:200], y[:200], tok, 4, max_length=12)
    test = text.tokenize(texts[200:], y[200:], tok, 4, max_length=12)
    part = data.dirichlet_lda(train.y, 6, alpha=0.5, seed=1, min_size=5)
    return tok, train, test, part


def _update_err(sim, g, ref, g0):
    """max |engine - loop| / max |loop - start| over the identifiable parameters."""
    keep = torch.ones_like(g0, dtype=torch.bool)
    for s in sim.runtime.layout.params:
        if s.name.endswith(UNIDENTIFIABLE):
            keep[s.offset : s.offset + s.numel] = False
    return float((g - ref)[keep].abs().max() / (ref - g0)[keep].abs().max())


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("make,attn", [("distilbert", "sdpa"), ("distilbert", "eager"), ("bert", "sdpa")])
def test_grouped_executor_equals_each_clients_own_model(task, make, attn):
    """Three clients with different weights on padded batches: logits and every gradient equal functional_call of
    each client's own weights (BERT adds token-type ids and a pooler)."""
    from torch.func import functional_call

    tok, train, _, _ = task
    cfg = th.distilbert_config(4, len(tok), attn=attn) if make == "distilbert" else th.bert_config(4, len(tok))
    model = hf.from_config(cfg, seed=0)
    prog, why = grouped.plan(model)
    assert prog is not None, why
    g = torch.Generator().manual_seed(0)
    n, B = 3, 5
    params = {
        k: (v.detach() + 0.05 * torch.randn((n, *v.shape), generator=g)).requires_grad_()
        for k, v in model.named_parameters()
    }
    x, y = train.batch(torch.arange(n * B).view(n, B))
    assert (x[:, :, 1] == 0).any() and (x[:, :, 0] == 0).any()  # padded rows and pad tokens present
    out = prog.forward(params, x, True)
    loss = torch.nn.functional.cross_entropy(out.reshape(n * B, -1), y.reshape(-1))
    got = torch.autograd.grad(loss, list(params.values()))
    for k in range(n):
        pk = {name: v[k].detach().clone().requires_grad_() for name, v in params.items()}
        ref = functional_call(model, pk, (x[k],))
        assert (out[k] - ref).abs().max() <= 1e-5 * ref.abs().max()
        lk = torch.nn.functional.cross_entropy(ref, y[k], reduction="sum") / (n * B)
        gref = torch.autograd.grad(lk, list(pk.values()))
        for name, a, b in zip(params, got, gref, strict=True):
            if not name.endswith(UNIDENTIFIABLE):
                assert (a[k] - b).abs().max() <= 1e-5 * max(float(b.abs().max()), 1e-6), name


def test_grouped_plan_says_why_not():
    from torch import nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(self.emb(x).mean(1))

    for model, why in (
        (Tied(), "shared with another layer"),
        (nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), "normalises over the batch"),
        (nn.Sequential(nn.Conv1d(2, 2, 1, bias=False)), "0.weight is not the weight or bias of a Linear"),
    ):
        prog, reason = grouped.plan(model)
        assert prog is None and why in reason, reason
    prog, _ = grouped.plan(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False)))
    assert prog is not None and not list(prog.model.parameters())  # the copy holds no weights


def test_grouped_executor_pad_rows_of_embeddings_get_no_gradient(task):
    tok, train, _, _ = task
    model = hf.from_config(th.distilbert_config(4, len(tok)), seed=0)
    prog, _ = grouped.plan(model)
    params = {k: v.detach()[None].repeat(2, *[1] * v.dim()).requires_grad_() for k, v in model.named_parameters()}
    x, _ = train.batch(torch.arange(8).view(2, 4))
    prog.forward(params, x, True).sum().backward()
    emb = params["hf.distilbert.embeddings.word_embeddings.weight"].grad
    assert emb[:, 0].abs().max() == 0 and emb[:, 2].abs().max() > 0  # [PAD] none, [CLS] some


@pytest.mark.parametrize(
    "algorithm,options",
    [
        ("fedavg", {}),
        ("fedgkd", {}),
        ("fedgkd", dict(buffer=1)),
        ("fedgkd_vote", dict(buffer=3)),
        ("fedprox", dict(mu=0.1)),
        ("moon", dict(mu=0.1)),
    ],
)
@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap of CPU SDPA: torch's per-client fallback
def test_rounds_match_the_sequential_loop(task, algorithm, options, executor):
    """FedGKD's NLP methods with Adam (Table 4's optimizer) on a tiny DistilBERT: the engine's global model after
    three rounds equals the plain loop's (per-client modules, torch.optim.Adam, state_dict averaging)."""
    tok, train, test, part = task
    model = hf.from_config(th.distilbert_config(4, len(tok)), seed=0)
    cfg = fedfast.SimConfig(
        algorithm=algorithm,
        options=options,
        clients_per_round=3,
        rounds=3,
        local_epochs=2,
        batch_size=8,
        lr=5e-3,
        client_optimizer="adam",
        seed=3,
        executor=executor,
    )
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, val=test)
    g0 = _flat(sim.model)  # the model the engine trains (MOON: with its projection head)
    ref = sequential(cfg, copy.deepcopy(sim.model), train, part, cfg.rounds, val=test)
    assert isinstance(sim.trainer.stack.plan, grouped.GroupedPlan) == (executor == "auto")
    sim.run()
    err = _update_err(sim, sim.global_flat, ref, g0)
    assert err <= 1e-3, err


def test_the_loop_comparison_can_fail(task):
    """A wrong Adam beta1 in the engine is far outside the tolerance above."""
    tok, train, test, part = task
    model = hf.from_config(th.distilbert_config(4, len(tok)), seed=0)
    g0 = _flat(model)
    kw = dict(
        algorithm="fedgkd",
        clients_per_round=3,
        rounds=2,
        local_epochs=2,
        batch_size=8,
        lr=1e-3,
        seed=3,
        client_optimizer="adam",
    )
    ref = sequential(fedfast.SimConfig(**kw), model, train, part, 2)
    sim = fedfast.Simulation(fedfast.SimConfig(adam_betas=(0.8, 0.999), **kw), copy.deepcopy(model), train, test, part)
    sim.run()
    assert _update_err(sim, sim.global_flat, ref, g0) > 1e-2


def test_core_import_does_not_import_transformers():
    import subprocess

    code = (
        "import sys, fedfast, fedfast.models.hf, fedfast.data.text, fedfast.grouped; "
        "assert 'transformers' not in sys.modules and 'tokenizers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"fedfast\[text\]"):
        hf.load("hf:distilbert-base-uncased", 4)


def _write_ag_news(d, n_train=60, n_test=20):
    texts, y = th.sentences(n_train + n_test, 4, seed=1)
    for name, rows in (("train.csv", range(n_train)), ("test.csv", range(n_train, n_train + n_test))):
        (d / name).write_text(
            "".join(f'"{int(y[i]) + 1}","{texts[i].split()[0]}","{" ".join(texts[i].split()[1:])}"\n' for i in rows),
            encoding="utf-8",
        )
    return texts


def test_tokenise_once_and_cache_beside_the_data(tmp_path, monkeypatch):
    texts = _write_ag_news(tmp_path)
    tok = th.tokenizer(texts)
    train, test = text.load_ag_news(str(tmp_path), tok, max_length=10)
    assert isinstance(train, text.TokenDataset) and len(train) == 60 and len(test) == 20 and train.num_classes == 4
    assert train.x.dtype == torch.int32 and train.x.shape[1] == 2 and train.seq_len <= 10
    assert train.x[:, 0, 0].eq(tok.cls_token_id).all()  # [CLS] first
    L = train.x[:, 1].sum(1)
    assert train.x[torch.arange(60), 0, L - 1].eq(tok.sep_token_id).all()  # [SEP] last, also when truncated
    assert (train.x[:, 0] == tok.pad_token_id).eq(train.x[:, 1] == 0).all()  # pad exactly where the mask is 0
    ref = tok(texts[0], truncation=True, max_length=10)["input_ids"]
    assert train.x[0, 0, : len(ref)].tolist() == ref
    caches = sorted(p.name for p in tmp_path.glob("*.tokens.npz"))
    assert len(caches) == 2 and caches[0].startswith("test.csv.") and caches[1].startswith("train.csv.")
    monkeypatch.setattr(text, "tokenize", lambda *a, **k: pytest.fail("tokenised again despite the cache"))
    again, _ = text.load_ag_news(str(tmp_path), tok, max_length=10)
    assert torch.equal(again.x, train.x) and torch.equal(again.y, train.y)
    monkeypatch.undo()
    # another max_length or tokenizer: another cache file; a damaged cache is rebuilt
    text.load_ag_news(str(tmp_path), tok, max_length=6)
    assert len(list(tmp_path.glob("train.csv.*.tokens.npz"))) == 2
    for p in tmp_path.glob("*.tokens.npz"):
        p.write_bytes(b"not a zip")
    rebuilt, _ = text.load_ag_news(str(tmp_path), tok, max_length=10)
    assert torch.equal(rebuilt.x, train.x)
    # an edited data file is tokenised afresh
    (tmp_path / "train.csv").write_text('"2","only","one row"\n', encoding="utf-8")
    edited, _ = text.load_ag_news(str(tmp_path), tok, max_length=10)
    assert len(edited) == 1 and edited.y.tolist() == [1]


def test_read_only_data_directory_caches_in_the_user_cache(tmp_path, monkeypatch):
    d = tmp_path / "data"
    d.mkdir()
    texts = _write_ag_news(d)
    monkeypatch.setenv("FEDFAST_CACHE", str(tmp_path / "cache"))
    write = text.write_atomic

    def read_only(path, payload):  # the data directory refuses writes (as for a non-root user without permission)
        if os.path.dirname(os.path.abspath(path)) == str(d):
            raise PermissionError(13, "Permission denied", path)
        write(path, payload)

    monkeypatch.setattr(text, "write_atomic", read_only)  # where the cache writer looks it up
    text.load_ag_news(str(d), th.tokenizer(texts), max_length=10)
    assert len(list((tmp_path / "cache").glob("*.tokens.npz"))) == 2 and not list(d.glob("*.npz"))
    monkeypatch.setattr(text, "tokenize", lambda *a, **k: pytest.fail("tokenised again despite the cache"))
    text.load_ag_news(str(d), th.tokenizer(texts), max_length=10)


def test_sst5_loader_and_missing_files(tmp_path):
    import json

    texts, y = th.sentences(30, 5, seed=2)
    for name, rows in (("train.jsonl", range(20)), ("test.jsonl", range(20, 30))):
        (tmp_path / name).write_text("\n".join(json.dumps({"text": texts[i], "label": int(y[i])}) for i in rows))
    train, test = text.load_sst5(str(tmp_path), th.tokenizer(texts), max_length=8)
    assert (len(train), len(test), train.num_classes) == (20, 10, 5) and train.y.tolist() == y[:20].tolist()
    with pytest.raises(FileNotFoundError, match=r"train.jsonl: not found.*SetFit/sst5"):
        text.load_sst5(str(tmp_path / "nowhere"), None)
    with pytest.raises(FileNotFoundError, match=r"train.csv: not found.*ag_news"):
        text.load_ag_news(str(tmp_path), None)


def test_bad_token_data_and_mismatched_models(task):
    tok, train, test, part = task
    with pytest.raises(ValueError, match=r"y: labels must lie in \[0, 4\)"):
        text.TokenDataset(train.x, train.y + 1, 4)
    with pytest.raises(ValueError, match=r"x: token data is an int32 tensor \[N, 2, L\]"):
        text.TokenDataset(train.x[:, :1], train.y, 4)
    with pytest.raises(ValueError, match="max_length: must be an integer >= 2"):
        text.tokenize(["a"], torch.tensor([0]), tok, 4, max_length=1)
    nopad = th.tokenizer(["a b"])
    nopad.pad_token = None
    with pytest.raises(ValueError, match="tokenizer: .* has no pad token"):
        text.tokenize(["a"], torch.tensor([0]), nopad, 4)
    cfg = fedfast.SimConfig(clients_per_round=2, batch_size=8, client_optimizer="adam")
    small = hf.from_config(th.distilbert_config(4, vocab_size=8), seed=0)  # another tokenizer's vocabulary
    with pytest.raises(ValueError, match=r"train: token id \d+ is beyond the model's vocabulary of 8"):
        fedfast.Simulation(cfg, small, train, test, part)
    short = hf.from_config(th.distilbert_config(4, len(tok), max_positions=6), seed=0)
    with pytest.raises(ValueError, match="max_length: sequences of 12 tokens exceed the model's 6 positions"):
        fedfast.Simulation(cfg, short, train, test, part)
    five = hf.from_config(th.distilbert_config(5, len(tok)), seed=0)
    with pytest.raises(ValueError, match="train: 4 classes, but the model's head has 5"):
        fedfast.Simulation(cfg, five, train, test, part)
    model = hf.from_config(th.distilbert_config(4, len(tok)), seed=0)
    with pytest.raises(ValueError, match="augment: 'fedgkd' augments images"):
        fedfast.Simulation(fedfast.SimConfig(clients_per_round=2, augment="fedgkd"), model, train, test, part)
    imgs, _ = data.synthetic(4, 20, 10, (1, 4, 4))
    with pytest.raises(ValueError, match="a text model takes tokenised texts"):
        model.check_data(imgs)
    frozen = hf.from_config(th.distilbert_config(4, len(tok)), seed=0)
    frozen.hf.distilbert.embeddings.position_embeddings.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"model: parameters \['hf.distilbert.embeddings.position_embeddings"):
        fedfast.Simulation(cfg, frozen, train, test, part)


def _save_checkpoint(d, tok, num_labels=4, classifier=False, dim=16):
    """A tiny pretrained-style checkpoint directory (save_pretrained of a base model and the tokenizer)."""
    from transformers import DistilBertForSequenceClassification, DistilBertModel

    cfg = th.distilbert_config(num_labels, len(tok), dim=dim)
    torch.manual_seed(5)
    (DistilBertForSequenceClassification(cfg) if classifier else DistilBertModel(cfg)).save_pretrained(d)
    tok.save_pretrained(d)


def test_load_a_local_checkpoint(task, tmp_path):
    from transformers import DistilBertModel

    tok = task[0]
    _save_checkpoint(tmp_path / "ckpt", tok)
    model, tok2 = hf.load(f"hf:{tmp_path / 'ckpt'}", 4, seed=1)
    assert isinstance(model, hf.HFClassifier) and model.num_labels == 4 and len(tok2) == len(tok)
    base = DistilBertModel.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(model.hf.distilbert.embeddings.word_embeddings.weight, base.embeddings.word_embeddings.weight)
    again, _ = hf.load(str(tmp_path / "ckpt"), 4, seed=1)  # a plain directory works too; the head follows the seed
    other, _ = hf.load(str(tmp_path / "ckpt"), 4, seed=2)
    assert torch.equal(again.hf.classifier.weight, model.hf.classifier.weight)
    assert not torch.equal(other.hf.classifier.weight, model.hf.classifier.weight)
    assert tok2("w1 w2")["input_ids"] == tok("w1 w2")["input_ids"]
    with pytest.raises(FileNotFoundError, match="no such directory"):
        hf.load(f"hf:{tmp_path / 'nothing' / 'here'}", 4)
    with pytest.raises(ValueError, match="'hf:' needs a hub id or a directory"):
        hf.load("hf:", 4)
    _save_checkpoint(tmp_path / "clf", tok, num_labels=2, classifier=True)
    with pytest.raises(ValueError, match="is a classifier of 2 classes, the dataset has 4"):
        hf.load(str(tmp_path / "clf"), 4)


def test_hub_id_without_internet_says_how_to_get_it(tmp_path):
    """No network here: an uncached hub id fails with how to save it where there is internet (in a fresh process,
    as the hub library reads HF_HUB_OFFLINE at import)."""
    import subprocess

    code = (
        "import fedfast.models.hf as hf\n"
        "try:\n    hf.load('hf:distilbert-base-uncased', 4)\n"
        "except FileNotFoundError as e:\n    print(e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "model: cannot load the configuration of 'distilbert-base-uncased'" in out
    assert "save_pretrained('DIR')" in out and 'model = "hf:DIR"' in out


def test_cli_runs_the_fedgkd_nlp_preset_on_local_files(task, tmp_path, capsys):
    """`fedfast run --preset fedgkd-table4/sst5` with a saved tiny checkpoint and SST-5 files the test writes:
    the tokenised data is cached beside the files, the run learns, and a second run reuses the cache."""
    import json

    from fedfast.cli import main

    texts, y = th.sentences(800, 5, seed=3)
    d = tmp_path / "sst5"
    d.mkdir()
    for name, rows in (("train.jsonl", range(600)), ("test.jsonl", range(600, 800))):
        (d / name).write_text("\n".join(json.dumps({"text": texts[i], "label": int(y[i])}) for i in rows))
    _save_checkpoint(tmp_path / "tiny", th.tokenizer(texts), num_labels=5, dim=32)
    args = [
        "run",
        "--preset",
        "fedgkd-table4/sst5",
        "--set",
        "algorithm=fedgkd",
        "--set",
        f"model=hf:{tmp_path / 'tiny'}",
        "--set",
        f"data_dir={d}",
        "--set",
        "rounds=6",
        "--set",
        "num_clients=10",
        "--set",
        "batch_size=16",
        "--set",
        "lr=3e-3",
        "--set",
        "local_epochs=2",
        "--set",
        "alpha=1.0",
        "--quiet",
    ]
    assert main(args + ["--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[-1]["best_test_accuracy"] > 0.4  # 5 classes: chance is 0.2
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["client_optimizer"] == "adam" and cfg["max_length"] == 128 and cfg["fedgkd"]["buffer"] == 1
    assert len(list(d.glob("*.tokens.npz"))) == 2
    for bad, msg in (
        ("model=mlp", "model: dataset 'sst5' holds texts; use a Hugging Face model"),
        ("dataset=mnist", "is a text model; dataset 'mnist' holds images"),
        ("train_fraction=0", "train_fraction: must lie in (0, 1]"),
    ):
        capsys.readouterr()
        assert main(args + ["--set", bad, "--out", str(tmp_path / "bad")]) == 2
        assert msg in capsys.readouterr().err
