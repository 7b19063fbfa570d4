"""``onecard.Settings``: a model service's settings, and nothing heavier than pydantic, so
that the supervisor's ``onecard check`` can validate a service's section (a settings module
that publishes ``SERVICE_SETTINGS``) without loading a model library."""

from services.runtime.pipeline.settings import ModelServiceSettings as Settings

__all__ = ["Settings"]
