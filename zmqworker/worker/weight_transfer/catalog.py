"""The model's weights by checkpoint name, and the checks an update's announcement passes
before any weight changes.

Dtypes: an update's tensors are in the model's own dtype (ModelConfig.dtype), exactly.
Nothing is cast: a cast would hide a trainer that sends another precision than the one
served (float32 master weights, say), and would cost a pass over the bytes.
"""

from __future__ import annotations

import difflib

from messages import WeightSpec, WeightUpdate
from zmqworker.distributed.weight_group import dtype_name
from zmqworker.models.llama import LlamaForCausalLM
from zmqworker.models.loader import whole_model
from zmqworker.models.weight_names import (
    TIED_HEAD,
    Targets,
    checkpoint_shapes,
    layout_names,
    ties_embeddings,
    weight_targets,
)

EMBEDDING = "model.embed_tokens.weight"  # what a tied model's head is


class WeightCatalog:
    """shapes: every weight name of the whole model -> its full shape (a tied model's
    lm_head.weight included, as the embedding's alias); targets: the slices this rank
    takes of each name (none for another stage's names and for the alias); aliases: a
    tied model's lm_head.weight -> the embedding's name, whose value it must have (as a
    checkpoint's must: loader.py), since the model holds one tensor for both. A parameter
    that comes in more than one layout (experts as published, one tensor each, or
    stacked as transformers holds them) takes either: layouts (this rank's parameters)
    and choices (the whole model's parameters of several layouts) say which names go
    together."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        whole = whole_model(model)
        self.shapes = checkpoint_shapes(whole)
        self.aliases: dict[str, str] = {}
        if ties_embeddings(model):
            self.aliases[TIED_HEAD] = EMBEDDING
            self.shapes[TIED_HEAD] = self.shapes[EMBEDDING]
        self.targets: Targets = weight_targets(model)
        self.layouts = layout_names(model)
        self.choices = [names for names in layout_names(whole) if len(names) > 1]
        self.dtype = dtype_name(model.dtype)

    def check(self, update: WeightUpdate, require_all: bool) -> dict[str, WeightSpec]:
        """The update's tensors by name, once every one is a weight of the model in its
        shape and dtype, and none comes twice; require_all: the update must also give
        every weight this rank holds. A ValueError names the first tensor that fails."""
        specs: dict[str, WeightSpec] = {}
        for spec in update.tensors:
            self._check_one(spec)
            if spec.name in specs:
                raise ValueError(f"tensor {spec.name} comes twice in the update")
            specs[spec.name] = spec
        given = specs.keys()
        for layouts in self.choices:
            used = [sorted(names & given)[0] for names in layouts if names & given]
            if len(used) > 1:
                raise ValueError(
                    f"tensors {used[0]} and {used[1]} are two layouts of the same weights "
                    "(experts one tensor each, or stacked): an update gives one of them"
                )
        if require_all:
            missing = sorted(
                {
                    name
                    for layouts in self.layouts
                    if not any(names <= given for names in layouts)
                    for name in layouts[0] - given
                }
            )
            if missing:
                more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
                raise ValueError(
                    "the weights were released by sleep(level=2): an update must give all "
                    f"of them, and this one lacks {len(missing)}: "
                    f"{', '.join(missing[:5])}{more}"
                )
        return specs

    def _check_one(self, spec: WeightSpec) -> None:
        shape = self.shapes.get(spec.name)
        if shape is None:
            close = difflib.get_close_matches(spec.name, self.shapes, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"tensor {spec.name} is not a weight of this model{hint}")
        if tuple(spec.shape) != shape:
            raise ValueError(
                f"tensor {spec.name} has shape {list(spec.shape)}, the model's is {list(shape)}"
            )
        if spec.dtype != self.dtype:
            raise ValueError(
                f"tensor {spec.name} is {spec.dtype}, the model's weights are {self.dtype}: "
                "an update comes in the model's dtype (nothing is cast)"
            )
