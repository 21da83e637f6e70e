"""fastllm.patch in the training loop most users have, transformers.Trainer: a patched tiny Llama
trains and evaluates as the unpatched one does (same init, data and seed; fp32: 1e-5 on the loss,
1e-4 on gradients and parameters).

- gradient accumulation over padded micro-batches whose ignored labels differ in number: the
  Trainer hands the model `num_items_in_batch` (the accumulated batch's label count), and each
  micro-batch's loss is its summed loss over that count;
- a window of micro-batches with every label ignored (num_items_in_batch == 0): transformers'
  loss is 0 / 0 = nan with zero gradients, and the Trainer steps on (its nan filter keeps the
  logged loss); a nan gradient there would turn every parameter into nan;
- Trainer.evaluate with prediction_loss_only=False: compute_metrics gets the logits (the patched
  model returns logits=None only for a labelled forward in training, with grad)."""

import copy

import pytest
import torch

import fastllm

transformers = pytest.importorskip("transformers")

VOCAB = 300


def _model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="sdpa", pad_token_id=0))
    with torch.no_grad():  # HF initialises norms to 1: make them differ so their grads count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _rows(n=8):
    """n sequences of 5 to 13 tokens, the first 1 to 4 labels of each ignored (a prompt)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (5 + (3 * i) % 9,), generator=g)
        labels = ids.clone()
        labels[:1 + i % 4] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _collate(rows):
    """Right padding: pad id 0, attention_mask 0, label -100."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = r["input_ids"], 1, r["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _Grads(transformers.TrainerCallback):
    """Every parameter's gradient before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters()})


def _trainer(model, out, rows, **over):
    args = dict(output_dir=str(out), use_cpu=True, report_to=[], dataloader_num_workers=0,
                max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", logging_steps=1,
                save_strategy="no", seed=0, disable_tqdm=True, train_sampling_strategy="sequential")
    args.update(over)
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**args),
                                train_dataset=rows, eval_dataset=rows, data_collator=_collate)


def _train(model, out, rows, steps):
    grads = _Grads()
    trainer = _trainer(model, out, rows, max_steps=steps)
    assert trainer.model_accepts_loss_kwargs  # num_items_in_batch reaches the model
    trainer.add_callback(grads)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], grads.steps


def _assert_close(got, want, rtol, name):
    scale = want.abs().max().item() + 1e-30
    err = (got - want).abs().max().item()
    assert err <= rtol * scale, f"{name}: error {err:.3g} vs scale {scale:.3g}"


def _assert_same_training(reference, tmp_path, rows, steps):
    """Trains a patched copy of reference, then reference; returns reference's gradients."""
    ours = copy.deepcopy(reference)
    fastllm.patch(ours)
    losses, grads = _train(ours, tmp_path, rows, steps)
    want_losses, want_grads = _train(reference, tmp_path, rows, steps)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
    assert len(grads) == len(want_grads) == steps
    for step, want in zip(grads, want_grads):
        for name, g in step.items():
            _assert_close(g, want[name], 1e-4, name)
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        _assert_close(p.detach(), q.detach(), 1e-4, name)
    return want_grads


def test_trainer_grad_accumulation_matches_unpatched(tmp_path):
    _assert_same_training(_model(), tmp_path, _rows(), steps=2)


def test_trainer_window_with_every_label_ignored_matches_unpatched(tmp_path):
    rows = _rows()
    for row in rows[:4]:  # the step's two micro-batches: num_items_in_batch == 0
        row["labels"][:] = -100
    want_grads = _assert_same_training(_model(), tmp_path, rows, steps=1)
    assert all(not g.any() for g in want_grads[0].values())  # transformers' zero gradients


# the Trainer's count is a float tensor (divided by the tp/cp/sp sizes); a custom loop's an int
@pytest.mark.parametrize("count", [torch.tensor(0.0), 0])
def test_no_items_gives_transformers_nan_loss_and_zero_grads(count):
    model = fastllm.patch(_model())
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=torch.full_like(ids, -100), num_items_in_batch=count)
    assert out.logits is None and out.loss.isnan()
    out.loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_trainer_evaluate_gives_metrics_the_logits(tmp_path):
    seen = []

    def metrics(prediction):
        seen.append(torch.from_numpy(prediction.predictions))
        return {}

    rows = _rows(6)
    results = []
    for patch in (True, False):
        model = _model()
        if patch:
            fastllm.patch(model)
        trainer = _trainer(model, tmp_path, rows, per_device_eval_batch_size=4,
                           prediction_loss_only=False)
        trainer.compute_metrics = metrics
        results.append(trainer.evaluate()["eval_loss"])
    ours, theirs = seen
    assert ours.shape == (6, 11, VOCAB)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=0)


def test_per_item_keeps_the_loss_dtype():
    """A float count (a Trainer's num_items_in_batch may be one) divides a bf16 loss into bf16,
    as `loss / count` does."""
    from fastllm import _hf

    loss = torch.tensor(6.0, dtype=torch.bfloat16)
    for count in (4.0, torch.tensor(4.0, dtype=torch.float64), 4, torch.tensor(4)):
        out = _hf.per_item(loss, count)
        assert out.dtype == torch.bfloat16 and float(out) == 1.5, count
