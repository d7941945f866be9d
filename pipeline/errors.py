"""The domain's user-facing errors, under the project's root `store.errors.UserError`."""

from __future__ import annotations

from store.errors import UserError


class TargetError(UserError):
    """A target model that cannot be loaded or run as asked (path, files, device, kernels)."""


class DatasetError(UserError):
    """A prompt set that cannot be read, or a row that is not what its fields say."""


class DrafterError(UserError):
    """A drafter config or checkpoint that is invalid, does not load strictly, or does not fit the store."""


class EngineError(UserError):
    """A reference server that cannot be reached, or does not serve what the store needs."""


class TrainingError(UserError):
    """A run that cannot go on: a non-finite loss, named with its step and samples."""


class PlanError(UserError):
    """A run that would not fit the cluster as planned (`pipeline plan`): the part that does not fit, the
    bytes it needs and what there is."""
