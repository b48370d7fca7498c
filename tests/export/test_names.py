"""Parameter names of ONNX weights, from every source: initializer names, dynamo's folded_from
metadata, node scopes of both exporters, deduplicated and tied weights, and a checkpoint
matched by content when the model carries none of that."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from autoshard.ir.onnx_import import file_weights, load_model
from autoshard.names import CheckpointError, load_checkpoint, recover_names

MODELS = Path(__file__).resolve().parents[2] / "models"


def names_of(path: Path, checkpoint=None) -> dict[str, list[str]]:
    model = load_model(path)
    found = recover_names(model, file_weights(model, path), checkpoint)
    return {w: [str(p) for p in entry.params] or [entry.note] for w, entry in found.items()}


@pytest.mark.parametrize(
    ("model", "weight", "params"),
    [
        ("mlp", "0.weight", ["0.weight (initializer)"]),
        ("gpt2", "lm.transformer.h.0.attn.c_attn.weight",
         ["lm.transformer.h.0.attn.c_attn.weight (initializer)"]),
        # TorchScript folds the tied LM head's transpose: its MatMul's scope names it.
        ("gpt2", "onnx::MatMul_592", ["lm.lm_head.weight.T (name_scope)"]),
        # dynamo keeps the tie: one initializer, read by the embedding's Gather too.
        ("gpt2_dynamo", "lm.lm_head.weight",
         ["lm.lm_head.weight (initializer)", "lm.transformer.wte.weight (name_scope)"]),
        ("bert", "onnx::MatMul_348",
         ["bert.encoder.layer.0.attention.self.query.weight.T (name_scope)"]),
        ("bert", "onnx::MatMul_360", ["bert.encoder.layer.0.output.dense.weight.T (name_scope)"]),
        ("block_dynamo", "val_2", ["0.up.weight.T (folded_from)"]),
        ("block_dynamo", "val_9", ["1.down.weight.T (folded_from)"]),
        # The fresh norms of both blocks are one deduplicated initializer.
        ("block_dynamo", "0.norm.weight", ["0.norm.weight (initializer)",
                                           "1.norm.weight (name_scope)"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
def test_names_from_the_graph(model, weight, params):
    assert names_of(MODELS / f"{model}.onnx")[weight] == params


@pytest.mark.parametrize("model", ["mlp", "gpt2", "gpt2_dynamo", "bert", "cnn", "block_dynamo"])
def test_every_bundled_weight_is_named(model):
    found = names_of(MODELS / f"{model}.onnx")
    assert found and all(" (" in p for params in found.values() for p in params)


def test_constants_are_not_parameters():
    found = names_of(MODELS / "gpt2_dynamo.onnx")
    assert "val_55" not in found and "val_81" not in found  # a shape, a scalar


# ---- a stripped export and the user's checkpoint ------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, data, offset = {}, b"", 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}  # fmt: skip
        data, offset = data + raw, offset + len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.fixture(scope="module")
def stripped(tmp_path_factory):
    """block_dynamo.onnx with every name and metadata gone (initializers w0.., nodes unnamed),
    and the torch state_dict of the module it was exported from."""
    model = onnx.load(MODELS / "block_dynamo.onnx")
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    state = {
        "0.norm.weight": arrays["0.norm.weight"], "1.norm.weight": arrays["0.norm.weight"],
        "0.norm.bias": arrays["0.norm.bias"], "1.norm.bias": arrays["0.norm.bias"],
        "0.up.weight": arrays["val_2"].T, "0.up.bias": arrays["0.up.bias"],
        "0.down.weight": arrays["val_4"].T, "1.up.weight": arrays["val_7"].T,
        "1.up.bias": arrays["1.up.bias"], "1.down.weight": arrays["val_9"].T,
    }  # fmt: skip
    renames = {t.name: f"w{i}" for i, t in enumerate(model.graph.initializer)}
    for t in model.graph.initializer:
        t.name = renames[t.name]
        del t.metadata_props[:]
    for node in model.graph.node:
        node.name = ""
        del node.metadata_props[:]
        node.input[:] = [renames.get(i, i) for i in node.input]
    del model.graph.value_info[:]
    folder = tmp_path_factory.mktemp("stripped")
    onnx.save(model, folder / "model.onnx")
    write_safetensors(folder / "model.safetensors", state)
    return folder, renames


def test_a_stripped_export_names_nothing_and_says_so(stripped):
    folder, renames = stripped
    found = names_of(folder / "model.onnx")
    assert found[renames["val_2"]] == [
        "no name: the initializer is not a module path, has no folded_from metadata, and no "
        "node reading it carries a module scope (give --checkpoint)"
    ]


def test_the_checkpoint_names_by_content(stripped):
    folder, renames = stripped
    found = names_of(folder / "model.onnx", load_checkpoint(folder / "model.safetensors"))
    assert found[renames["val_2"]] == ["0.up.weight.T (checkpoint)"]
    assert found[renames["1.up.bias"]] == ["1.up.bias (checkpoint)"]
    # The deduplicated norm weight is both blocks' (equal tensors in the checkpoint).
    assert found[renames["0.norm.weight"]] == ["0.norm.weight (checkpoint)",
                                                "1.norm.weight (checkpoint)"]  # fmt: skip


def test_the_checkpoint_narrows_to_the_graphs_names():
    # Equal fresh norms: content alone matches every one of them; the scopes pick.
    path = MODELS / "block_dynamo.onnx"
    model = onnx.load(path)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ones = arrays["0.norm.weight"]
    checkpoint = {"0.norm.weight": ones, "1.norm.weight": ones, "2.norm.weight": ones,
                  "0.up.weight": arrays["val_2"].T}  # fmt: skip
    found = names_of(path, checkpoint)
    assert found["0.norm.weight"] == ["0.norm.weight (checkpoint)", "1.norm.weight (checkpoint)"]
    assert found["val_2"] == ["0.up.weight.T (checkpoint)"]
    # Not in the checkpoint (a different tensor): the graph's name stays, with a note.
    entry = recover_names(model, file_weights(model, path), checkpoint)["val_9"]
    assert [str(p) for p in entry.params] == ["1.down.weight.T (folded_from)"]
    assert entry.note == "the checkpoint has no tensor equal to it, as stored or transposed"


def test_a_torch_state_dict(tmp_path):
    torch = pytest.importorskip("torch")
    model = onnx.load(MODELS / "mlp.onnx")
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    torch.save({"state_dict": {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}},
               tmp_path / "mlp.pt")  # fmt: skip
    found = names_of(MODELS / "mlp.onnx", load_checkpoint(tmp_path / "mlp.pt"))
    assert found["2.weight"] == ["2.weight (checkpoint)"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("none.safetensors", None, "cannot read checkpoint '{path}': no such file"),
        ("bad.safetensors", b"\x05\x00\x00\x00\x00\x00\x00\x00{nope", "cannot read checkpoint"),
    ],
)
def test_bad_checkpoints(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match="^" + message.format(path=path).replace("(", r"\(")):
        load_checkpoint(path)
