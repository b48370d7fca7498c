"""The source model's parameter name and layout of every weight of an ONNX model.

A plan names ONNX initializers; a user applies it to the torch module the model was exported
from. This maps each initializer to the parameter(s) it holds, from every source there is, and
says per weight how the name was found or why it could not be:

- the user's checkpoint (safetensors or a torch state_dict), matched by content, as stored or
  transposed: exact whenever the weights are present, and the only source that proves a layout;
- dynamo's folded weights (`val_41`): their value metadata `pkg.onnxscript.optimizer.folded_from`
  names the one parameter a transpose was folded from (`['model.layers.0.q_proj.weight']`);
- the initializer's own name when it is a module path (`transformer.h.0.ln_1.weight`): both
  exporters keep the names of the parameters they did not fold, in the parameter's layout;
- the module path of the nodes that read it: TorchScript node names (`/bert/encoder/layer.0/
  attention/self/query/MatMul`) and dynamo's `pkg.torch.onnx.name_scopes`, with the operand's
  role (a MatMul's B is a Linear's weight, transposed; a LayerNormalization's scale its weight).
  They name the parameters an initializer stands for when the exporter folded it
  (`onnx::MatMul_348`) or deduplicated it (one tensor for the equal norms of several layers),
  and the tied parameters read through it (GPT-2's embedding and LM head).

Small integer and scalar initializers (shapes, axes, epsilons) are constants, not parameters.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import ModelProto, NodeProto

from autoshard.errors import AutoshardError
from autoshard.ir.graph import Weight
from autoshard.ir.onnx_import import (
    FOLDED_FROM,
    file_weights,
    literal_names,
    load_model,
    value_metadata,
)

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_PATH = re.compile(r"\w+(\.\w+)+\Z")  # a module path with a leaf: `h.0.ln_1.weight`
_MODULE = re.compile(r"\w+(\.\w+)*\Z")

# (op type, operand index) -> (the parameter's leaf name, ONNX operand is its transpose).
# A MatMul's B is `x @ W.T` with the transpose folded: a Linear's weight stored [in, out].
# A Gemm's B follows transB (None: read the attribute).
ROLES: dict[tuple[str, int], tuple[str, bool | None]] = {
    ("MatMul", 1): ("weight", True),
    ("Gemm", 1): ("weight", None),
    ("Gemm", 2): ("bias", False),
    ("Add", 0): ("bias", False),
    ("Add", 1): ("bias", False),
    ("Gather", 0): ("weight", False),
    ("LayerNormalization", 1): ("weight", False),
    ("LayerNormalization", 2): ("bias", False),
    ("RMSNormalization", 1): ("weight", False),
    ("SimplifiedLayerNormalization", 1): ("weight", False),
    ("Conv", 1): ("weight", False),
    ("Conv", 2): ("bias", False),
    ("ConvTranspose", 1): ("weight", False),
    ("ConvTranspose", 2): ("bias", False),
    ("BatchNormalization", 1): ("weight", False),
    ("BatchNormalization", 2): ("bias", False),
    ("BatchNormalization", 3): ("running_mean", False),
    ("BatchNormalization", 4): ("running_var", False),
    ("Mul", 0): ("weight", False),  # RMSNorm's scale, in a norm module's scope
    ("Mul", 1): ("weight", False),
}


class CheckpointError(AutoshardError):
    """A checkpoint file that cannot be read as named tensors."""


class NameSource(enum.StrEnum):
    """How a parameter name was found, most trusted first."""

    CHECKPOINT = "checkpoint"
    FOLDED_FROM = "folded_from"
    INITIALIZER = "initializer"
    NAME_SCOPE = "name_scope"


@dataclass(frozen=True)
class Param:
    """A parameter of the source model that an ONNX weight holds; `transposed`: the ONNX weight
    is the parameter's transpose (a 2-D parameter, its dims swapped)."""

    name: str
    transposed: bool
    source: NameSource

    def __str__(self) -> str:
        return f"{self.name}{'.T' if self.transposed else ''} ({self.source})"


@dataclass(frozen=True)
class WeightName:
    """An ONNX weight and the parameters it holds (several when deduplicated or tied); none
    when no source names it, and `note` says why (or what the checkpoint contradicted)."""

    weight: str
    shape: tuple[int, ...]
    params: tuple[Param, ...]
    note: str = ""


def is_constant(weight: Weight) -> bool:
    """Shapes, axes, epsilons: not parameters (integer, or a float scalar)."""
    return not weight.dtype.startswith(("float", "bfloat")) or weight.size <= 1


# ---- graph sources ------------------------------------------------------------------------------


def _meta(props: Iterable[object]) -> dict[str, str]:
    return {p.key: p.value for p in props}  # type: ignore[attr-defined]


def module_path(node: NodeProto) -> str | None:
    """The module a node was exported from: the last of dynamo's name scopes (full paths), or
    a TorchScript node name's folders (`/bert/encoder/layer.0/attention/self/query/MatMul`)."""
    scopes = literal_names(_meta(node.metadata_props).get(NAME_SCOPES, ""))
    if len(scopes) >= 2:
        path = scopes[-2]
    elif node.name.startswith("/") and node.name.count("/") >= 2:
        path = ".".join(node.name.strip("/").split("/")[:-1])
    else:
        return None
    return path if _MODULE.match(path) else None


def _role(node: NodeProto, index: int) -> tuple[str, bool] | None:
    role = ROLES.get((node.op_type, index))
    if role is None:
        return None
    leaf, transposed = role
    if transposed is None:  # Gemm: B is [out, in] (torch's layout) when transB=1
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        transposed = not trans_b
    return leaf, transposed


Readers = Mapping[str, list[tuple[NodeProto, int]]]
"""Value name -> the nodes reading it, with the operand index."""


def _readers(model: ModelProto) -> Readers:
    readers: dict[str, list[tuple[NodeProto, int]]] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, index))
    return readers


def _scoped(readers: Readers, weight: Weight) -> list[Param]:
    """The parameters the readers of `weight` name: module path + operand role."""
    found: dict[str, Param] = {}
    for node, index in readers.get(weight.name, ()):
        role, module = _role(node, index), module_path(node)
        if role is None or module is None:
            continue
        if node.op_type in ("Add", "Mul") and len(weight.shape) != 1:
            continue  # an Add/Mul operand that is a parameter is a bias or a norm scale: 1-D
        leaf, transposed = role
        name = f"{module}.{leaf}"
        found.setdefault(name, Param(name, transposed and len(weight.shape) == 2,
                                     NameSource.NAME_SCOPE))  # fmt: skip
    return list(found.values())


def _graph_params(readers: Readers, weight: Weight, meta: Mapping[str, str]) -> list[Param]:
    """Every name the graph gives `weight`: its folded source or its own name, then the
    parameters its readers' scopes name (aliases of a deduplicated or tied weight share the
    leaf: a `weight` stays a `weight`)."""
    folded = literal_names(meta.get(FOLDED_FROM, ""))
    own: Param | None = None
    if len(folded) == 1 and _PATH.match(folded[0]):
        # The dynamo exporter folds one rank-2 parameter only to transpose it (Linear's
        # `aten.t`); other folds keep the layout.
        own = Param(folded[0], len(weight.shape) == 2, NameSource.FOLDED_FROM)
    elif _PATH.match(weight.name):
        own = Param(weight.name, False, NameSource.INITIALIZER)
    scoped = _scoped(readers, weight)
    if own is None:
        return scoped
    leaf = own.name.rsplit(".", 1)[1]
    aliases = [
        Param(p.name, own.transposed, p.source)
        for p in scoped
        if p.name != own.name and p.name.rsplit(".", 1)[1] == leaf
    ]
    return [own, *aliases]


# ---- the checkpoint ------------------------------------------------------------------------------


def load_checkpoint(path: str | Path) -> dict[str, np.ndarray]:
    """Named tensors of a safetensors file, or of a torch `state_dict` file (needs torch)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"cannot read checkpoint '{path}': no such file")
    if path.suffix == ".safetensors":
        from autoshard.weights import WeightFileError, read_safetensors

        try:
            return read_safetensors(path)
        except (WeightFileError, KeyError, TypeError) as error:
            raise CheckpointError(f"cannot read checkpoint '{path}': {error}") from None
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"checkpoint '{path}' is not .safetensors: reading a torch state_dict needs torch "
            "(pip install 'autoshard[torch]')"
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a file that is not its own
        raise CheckpointError(f"cannot read checkpoint '{path}': {error}") from None
    for key in ("state_dict", "model"):  # a training checkpoint wrapping the state_dict
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping):
        raise CheckpointError(f"checkpoint '{path}' is not a state_dict (a name -> tensor map)")
    out: dict[str, np.ndarray] = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype != torch.bfloat16:
            out[str(name)] = tensor.detach().cpu().contiguous().numpy()
    return out


def _digest(array: np.ndarray) -> tuple[str, tuple[int, ...], str]:
    data = np.ascontiguousarray(array)
    return data.dtype.str, data.shape, hashlib.sha256(data.tobytes()).hexdigest()


def _content_index(checkpoint: Mapping[str, np.ndarray]) -> dict[tuple, list[str]]:
    index: dict[tuple, list[str]] = {}
    for name, array in sorted(checkpoint.items()):
        index.setdefault(_digest(array), []).append(name)
    return index


def _matched(weight: Weight, index: Mapping[tuple, list[str]]) -> list[Param]:
    """The checkpoint's tensors equal to `weight` as stored, else transposed."""
    array = weight.load()
    stored = index.get(_digest(array), [])
    if stored or array.ndim != 2:
        return [Param(n, False, NameSource.CHECKPOINT) for n in stored]
    return [Param(n, True, NameSource.CHECKPOINT) for n in index.get(_digest(array.T), [])]


# ---- all together ------------------------------------------------------------------------------


def recover_names(
    model: ModelProto,
    weights: Mapping[str, Weight],
    checkpoint: Mapping[str, np.ndarray] | None = None,
) -> dict[str, WeightName]:
    """Every parameter-like weight (see `is_constant`) -> the parameters it holds.

    With a checkpoint, content decides: the tensors equal to the weight, narrowed to those the
    graph also names when it names some of them (equal fresh norms of several layers match
    one another). A weight the checkpoint has no equal of keeps the graph's names, with a note.
    """
    meta = value_metadata(model)
    index = _content_index(checkpoint) if checkpoint is not None else None
    readers = _readers(model)
    out: dict[str, WeightName] = {}
    for name, weight in weights.items():
        if is_constant(weight):
            continue
        graph = _graph_params(readers, weight, meta.get(name, {}))
        note = ""
        params = graph
        if index is not None and not weight.has_data:
            note = "no weight data in the model to match against the checkpoint"
        elif index is not None:
            matched = _matched(weight, index)
            named = {p.name for p in graph}
            narrowed = [p for p in matched if p.name in named]
            if matched:
                params = narrowed or matched
            else:
                note = "the checkpoint has no tensor equal to it, as stored or transposed"
        if not params:
            note = note or (
                "no name: the initializer is not a module path, has no folded_from metadata, and "
                "no node reading it carries a module scope (give --checkpoint)"
            )
        out[name] = WeightName(name, weight.shape, tuple(params), note)
    return out


def parameter_names(path: str | Path) -> dict[str, str]:
    """Each weight of the model file named by a source -> its most trusted parameter name
    (what a plan's story calls it; a weight no source names keeps its initializer name)."""
    proto = load_model(path)
    order = list(NameSource)
    return {
        weight: min(entry.params, key=lambda p: (order.index(p.source), p.name)).name
        for weight, entry in recover_names(proto, file_weights(proto, path)).items()
        if entry.params
    }
