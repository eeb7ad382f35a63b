"""Flow parameters at the top level, defined once as a pydantic model.

``@takes(Model)`` under ``@flow`` gives the flow one parameter per field of
``Model`` (name, type, default, title, description and bounds), so a deployment
run is ``--param keep_last=2`` rather than ``--params '{"params": {...}}'``,
and the UI still renders the model's fields as its form. The flow function
itself receives one validated ``Model`` instance.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")


def signature_of(model: type[BaseModel]) -> inspect.Signature:
    """One keyword parameter per field; the field (bounds, title) rides in ``Annotated``.

    Prefect titles each form field with the parameter's name; the model's title
    and description go into the field's description (a ``Field`` default, which
    Prefect reads for the schema and resolves to its value for a call)."""
    params = []
    for name, field in model.model_fields.items():
        text = ": ".join(t for t in (field.title, field.description) if t) or None
        value = ... if field.is_required() else field.get_default()
        default = Field(value, description=text)
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=default,
                annotation=Annotated[field.annotation, field],
            )
        )
    return inspect.Signature(params)


def takes(model: type[M]) -> Callable[[Callable[[M], R]], Callable[..., R]]:
    """Expose ``fn(params: model)`` as ``fn(**fields of model)`` (see module doc)."""

    def wrap(fn: Callable[[M], R]) -> Callable[..., R]:
        sig = signature_of(model)

        @functools.wraps(fn)
        def flow_fn(*args: Any, **kwargs: Any) -> R:
            bound = sig.bind(*args, **kwargs)
            # A required field left out arrives as its Field default: let the model name it.
            given = {k: v for k, v in bound.arguments.items() if not isinstance(v, FieldInfo)}
            return fn(model(**given))

        del flow_fn.__wrapped__  # Prefect must see the fields, not ``params``
        flow_fn.__signature__ = sig  # type: ignore[attr-defined]
        flow_fn.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()}
        flow_fn.params_model = model  # type: ignore[attr-defined]
        return flow_fn

    return wrap
