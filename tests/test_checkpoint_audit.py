"""Files a run or a user depends on: checkpoints that survive faults, adapters and exports that
refuse bad input with an error naming the file. Faults are injected by monkeypatching, so every
test is deterministic and single-process."""

import errno
import json
import os
import types

import pytest
import torch

from fastllm import adapters, export
from fastllm.lora import inject_lora, load_adapter, save_adapter
from fastllm.train import checkpoint as ckpt


def _save(output_dir, step, value=0.0):
    """A minimal checkpoint-<step> holding every file the loader reads."""
    def tensor_file(obj):
        return lambda path: ckpt.save_file(obj, path)

    return ckpt.save(output_dir, step, {
        "trainer_state.pt": tensor_file({"step": step}),
        "optimizer.pt": tensor_file({"state": {}, "param_groups": []}),
        "model.pt": tensor_file({"w": torch.full((4, 3), value)}),
    })


# ----- checkpoint.py -----

def test_unreadable_checkpoint_file_falls_back_to_the_previous(tmp_path, monkeypatch):
    out = str(tmp_path)
    _save(out, 3)
    newest = _save(out, 6)
    real = ckpt._sha256

    def bad_disk(path):
        if path.startswith(newest):
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path)

    monkeypatch.setattr(ckpt, "_sha256", bad_disk)
    with pytest.raises(ckpt.CheckpointError, match="cannot be read"):
        ckpt.verify(newest)
    messages = []
    assert ckpt.latest_valid(out, log=messages.append)[0] == 3
    assert "checkpoint-6" in messages[0]


def test_failed_rename_over_a_checkpoint_keeps_the_old_one(tmp_path, monkeypatch):
    out = str(tmp_path)
    path = _save(out, 3, value=1.0)
    real = os.rename

    def fails_into_place(src, dst):
        if ".tmp-checkpoint-" in os.fspath(src):
            raise OSError(errno.EIO, "simulated failure renaming the new checkpoint")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", fails_into_place)
    with pytest.raises(OSError, match="simulated failure"):
        _save(out, 3, value=2.0)
    monkeypatch.setattr(ckpt.os, "rename", real)
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [3]
    ckpt.verify(path)
    assert ckpt.load_file(os.path.join(path, "model.pt"))["w"][0, 0] == 1.0


def test_a_full_disk_anywhere_in_a_save_is_a_checkpoint_error_and_leaves_nothing(tmp_path,
                                                                                 monkeypatch):
    """ENOSPC in a writer was a CheckpointError naming it; in the manifest's write it was a raw
    OSError (a traceback where the CLI gives clear errors) and the temporary folder stayed."""
    def writer(path):
        with open(path, "wb") as f:
            f.write(b"x" * 10)

    def disk_full(obj, f, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.json, "dump", disk_full)
    with pytest.raises(ckpt.CheckpointError, match=r"ENOSPC\) while writing .*manifest"):
        ckpt.save(str(tmp_path), 2, {name: writer for name in ckpt.REQUIRED})
    assert os.listdir(tmp_path) == []


def test_crash_between_the_renames_of_a_replace_restores_the_old_one(tmp_path):
    out = str(tmp_path)
    path = _save(out, 3, value=1.0)
    _save(out, 4)
    # what a SIGKILL between save's two renames leaves when it replaces checkpoint-3: the old
    # one stepped aside, the new one still under its temporary name
    os.rename(path, path + ".old-deadbeef")
    os.rename(os.path.join(out, "checkpoint-4"), os.path.join(out, ".tmp-checkpoint-3-cafe"))
    assert ckpt.list_checkpoints(out) == []
    ckpt.remove_partial(out)  # what the next run does first (run_dir.prepare)
    assert ckpt.latest_valid(out, log=lambda *_: None) == (3, path)
    assert ckpt.load_file(os.path.join(path, "model.pt"))["w"][0, 0] == 1.0
    assert sorted(os.listdir(out)) == ["checkpoint-3"]


# ----- export.py -----

def test_export_verifies_a_checkpoint_folder_given_directly(tmp_path):
    path = _save(str(tmp_path), 3)
    model = os.path.join(path, "model.pt")
    data = bytearray(open(model, "rb").read())
    data[-40] ^= 0xFF  # inside the tensor's bytes: torch.load would load the wrong weights
    open(model, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="model.pt does not match its sha256"):
        export._checkpoint(path)


class _Tiny(torch.nn.Module):
    """Enough of a transformers model for export(): q_proj/v_proj, a config, save_pretrained."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)
        self.v_proj = torch.nn.Linear(8, 8)
        self.config = types.SimpleNamespace(_name_or_path=None)
        self.generation_config = types.SimpleNamespace(save_pretrained=lambda d: None)

    def save_pretrained(self, out_dir):
        from safetensors.torch import save_file

        save_file(dict(self.state_dict()), os.path.join(out_dir, "model.safetensors"))
        open(os.path.join(out_dir, "config.json"), "w").write("{}")


def _fake_run(tmp_path, monkeypatch):
    """export.load_run made to give a _Tiny with LoRA, its base a folder (no tokenizer files)."""
    base = tmp_path / "base"
    base.mkdir()

    def load_run(run_dir):
        model = _Tiny()
        inject_lora(model, r=2)
        return model, types.SimpleNamespace(eos_token_id=2), types.SimpleNamespace(
            model=str(base))

    monkeypatch.setattr(export, "load_run", load_run)


def test_export_refuses_the_runs_own_model_folder_and_run_folder(tmp_path, monkeypatch):
    """A merged export into the run's model folder replaced the base the run (its adapter,
    every later load, resume) builds on; one into the run folder mixed the two."""
    _fake_run(tmp_path, monkeypatch)
    (tmp_path / "base" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is the run's own model folder"):
        export.export(str(tmp_path / "run"), str(tmp_path / "base"), merged=True)
    assert os.listdir(tmp_path / "base") == ["config.json"]
    with pytest.raises(ValueError, match="is the run folder .* itself"):
        export.export(str(tmp_path / "run"), str(tmp_path / "run"), merged=True)
    export.export(str(tmp_path / "run"), str(tmp_path / "run" / "export"), merged=True)


def test_generate_loads_a_model_folder_that_holds_a_config_yaml(tmp_path):
    """A Hugging Face (or exported) folder with a training config.yaml kept beside it was taken
    for a fastllm run and refused ("holds no valid checkpoint"); transformers loads it."""
    import transformers

    from _tiny_tokenizer import tiny_bpe

    folder = str(tmp_path / "model")
    tok = tiny_bpe()
    tok.save_pretrained(folder)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    (tmp_path / "model" / "config.yaml").write_text("model: tiny\nmax_steps: 3\n")
    model, tokenizer = export.load_model(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.vocab_size == len(tok)


@pytest.mark.parametrize("first_merged", [False, True])
def test_export_refuses_an_out_dir_holding_the_other_layout(tmp_path, monkeypatch, first_merged):
    _fake_run(tmp_path, monkeypatch)
    out = str(tmp_path / "out")
    export.export("run", out, merged=first_merged)
    before = sorted(os.listdir(out))
    stale = "config.json" if first_merged else "adapter_config.json"
    with pytest.raises(ValueError, match=stale):
        export.export("run", out, merged=not first_merged)
    assert sorted(os.listdir(out)) == before


def test_export_replaces_an_earlier_exports_files_and_writes_nothing_when_it_fails(
        tmp_path, monkeypatch):
    """An earlier export's chat template (save_pretrained leaves files it does not write) came
    back with the new tokenizer; a refused export (a tied head merged) left a half-written
    folder. Now the files are staged and moved in at the end, an earlier export's removed."""
    _fake_run(tmp_path, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("chat_template.jinja", "model-00001-of-00002.safetensors", "README.md"):
        (out / name).write_text("earlier")
    export.export("run", str(out), merged=True)
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]

    def fail(self, out_dir):
        open(os.path.join(out_dir, "model.safetensors"), "w").write("half")
        raise OSError("disk full")

    monkeypatch.setattr(_Tiny, "save_pretrained", fail)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    with pytest.raises(OSError, match="disk full"):
        export.export("run", str(out), merged=True)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert [n for n in os.listdir(tmp_path) if "export" in n] == []  # the stage is gone


def _files(*names):
    """A checkpoint writer of a folder holding `names`."""
    def write(path):
        os.makedirs(path)
        for name in names:
            open(os.path.join(path, name), "w").write("{}")
    return write


def test_a_file_the_loader_reads_must_be_listed(tmp_path):
    """load_prefix reads adapter/prefix_encoder.safetensors whenever it is there: one the
    manifest does not list (added, or its entry dropped) is not checksummed, so a truncated one
    passed verify() and crashed the resume."""
    from fastllm.prefix import RESUME_WEIGHTS

    assert ckpt.READ_IF_PRESENT == (f"adapter/{RESUME_WEIGHTS}",)
    out = str(tmp_path)
    _save(out, 3)
    newest = ckpt.save(out, 6, {
        "trainer_state.pt": lambda path: ckpt.save_file({"step": 6}, path),
        "optimizer.pt": lambda path: ckpt.save_file({}, path),
        "adapter": _files("adapter_config.json", "adapter_model.safetensors", RESUME_WEIGHTS)})
    manifest = os.path.join(newest, ckpt.MANIFEST)
    data = json.load(open(manifest))
    del data["files"][f"adapter/{RESUME_WEIGHTS}"]
    json.dump(data, open(manifest, "w"))
    with pytest.raises(ckpt.CheckpointError, match=f"{RESUME_WEIGHTS} is there but not in"):
        ckpt.verify(newest)
    assert ckpt.latest_valid(out, log=lambda m: None)[0] == 3


@pytest.mark.parametrize("link", ["trainer_state.pt", "folder"])
def test_a_checkpoint_file_linked_from_outside_is_refused(tmp_path, link):
    """os.path.isfile follows symlinks: a checkpoint whose files (or folders) link elsewhere
    passed verify() while '..' in a manifest name is refused as outside the checkpoint."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    path = ckpt.save(str(out), 3, {
        "trainer_state.pt": lambda p: ckpt.save_file({"step": 3}, p),
        "optimizer.pt": lambda p: ckpt.save_file({}, p),
        "sub": _files("model.pt"),
        "model.pt": lambda p: ckpt.save_file({"w": torch.ones(2)}, p)})
    ckpt.verify(path)
    name = "trainer_state.pt" if link == "trainer_state.pt" else "sub"
    os.rename(os.path.join(path, name), outside / name)
    os.symlink(outside / name, os.path.join(path, name))
    with pytest.raises(ckpt.CheckpointError, match="outside the checkpoint"):
        ckpt.verify(path)


def test_load_model_names_an_adapter_config_that_is_not_an_object(tmp_path):
    (tmp_path / "adapter_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="adapter_config.json holds a JSON list"):
        export.load_model(str(tmp_path))


def test_export_into_a_link_to_another_filesystem_and_an_unwritable_parent(tmp_path,
                                                                           monkeypatch):
    """The stage sat beside OUT_DIR: a link to another filesystem failed at os.replace (after
    the earlier export's files were removed), and a folder whose parent is not writable (the
    current folder, a home folder) could not be exported into. It is inside OUT_DIR now."""
    import tempfile

    _fake_run(tmp_path, monkeypatch)
    elsewhere = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    try:
        if elsewhere is not None:  # (tmpfs: another filesystem than tmp_path's, usually)
            (tmp_path / "link").symlink_to(elsewhere)
            export.export("run", str(tmp_path / "link"), merged=True)
            assert sorted(os.listdir(elsewhere)) == ["config.json", "model.safetensors"]
        made = []
        real_mkdtemp = tempfile.mkdtemp

        def only_inside(prefix=None, dir=None, **kw):  # the parent refuses writes
            assert os.path.abspath(dir).startswith(str(tmp_path / "out")), dir
            made.append(real_mkdtemp(prefix=prefix, dir=dir, **kw))
            return made[-1]

        monkeypatch.setattr(tempfile, "mkdtemp", only_inside)
        (tmp_path / "out").mkdir()
        export.export("run", str(tmp_path / "out"), merged=True)
        assert made and sorted(os.listdir(tmp_path / "out")) == ["config.json",
                                                                 "model.safetensors"]
    finally:
        if elsewhere is not None:
            import shutil

            shutil.rmtree(elsewhere)


# ----- adapters.py, lora.py -----

def _truncate(file):
    data = open(file, "rb").read()
    open(file, "wb").write(data[:len(data) // 2])


def _json_list(file):
    open(file, "w").write("[1, 2]")


@pytest.mark.parametrize("name,damage,says", [
    ("adapter_model.safetensors", _truncate, "not a valid safetensors file"),
    ("adapter_config.json", _truncate, "not valid JSON"),
    ("adapter_config.json", _json_list, "holds a JSON list"),
])
@pytest.mark.parametrize("loader", [load_adapter, adapters.load_adapter], ids=["lora", "adapters"])
def test_corrupt_adapter_files_are_named(tmp_path, name, damage, says, loader):
    model = _Tiny()
    inject_lora(model, r=2)
    save_adapter(model, str(tmp_path))
    damage(os.path.join(tmp_path, name))
    fresh = _Tiny()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=f"{name} .*{says}|{name} {says}"):
        loader(fresh, str(tmp_path))
    after = fresh.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_corrupt_prefix_adapter_files_are_named(tmp_path):
    """load_prefix reads the same two files: a truncated one is named, as for LoRA."""
    from fastllm.prefix import load_prefix

    (tmp_path / "adapter_config.json").write_text('{"peft_type": "PREFIX_TU')
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        load_prefix(None, str(tmp_path))


def _folder(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def test_a_refused_save_adapter_leaves_the_adapter_in_the_folder(tmp_path):
    first = _Tiny()
    inject_lora(first, r=2)
    with torch.no_grad():
        first.q_proj.lora_B.fill_(0.5)
    save_adapter(first, str(tmp_path))
    before = _folder(tmp_path)
    other = _Tiny()
    inject_lora(other, r=4)
    other.q_proj.dropout = 0.1  # one dropout per adapter in PEFT's format: refused
    with pytest.raises(ValueError, match="one dropout"):
        save_adapter(other, str(tmp_path))
    assert _folder(tmp_path) == before  # it wrote the weights and emptied the config before
    fresh = load_adapter(_Tiny(), str(tmp_path))
    assert torch.equal(fresh.q_proj.lora_B, first.q_proj.lora_B)


def test_a_save_adapter_failing_midway_leaves_the_adapter_in_the_folder(tmp_path, monkeypatch):
    first = _Tiny()
    inject_lora(first, r=2)
    save_adapter(first, str(tmp_path))
    before = _folder(tmp_path)

    def disk_full(obj, f, **kw):  # the config, written after the weights, fills the disk
        f.write('{"peft_type": "LO')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", disk_full)
    other = _Tiny()
    inject_lora(other, r=4)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(other, str(tmp_path))
    assert _folder(tmp_path) == before  # the new weights, written first, did not replace the old
    monkeypatch.undo()
    save_adapter(other, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert load_adapter(_Tiny(), str(tmp_path)).q_proj.r == 4
