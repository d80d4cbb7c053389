"""What a name may be: a job's id and a model's name, checked where they come in (a name
never becomes a path). Pure."""

from __future__ import annotations

import re

from scheduler.errors import InvalidRequest, shown

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_job_id(job_id: str) -> str:
    """A job id as jobs carry it: 1 to 64 letters, digits, '_' or '-'."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise InvalidRequest(
            f"job id {shown(job_id)} is not a job id: ids are 1 to 64 letters, digits, '_' or '-' "
            "(`ggufq jobs` lists the jobs not ended, and a gateway answer names its job in "
            "X-Ggufq-Job)"
        )
    return job_id


def check_model_name(name: str) -> str:
    """A model name, never a path: letters, digits, '.', '_', '-'; no '/', '\\' or '..'."""
    if "/" in name or "\\" in name or ".." in name or name.endswith(".gguf"):
        stem = re.split(r"[\\/]", name)[-1].removesuffix(".gguf") or "NAME"
        raise InvalidRequest(
            f"model {name!r} looks like a file path; jobs name models, not files: put the file in "
            f"GGUFQ_MODELS_DIR and use its stem (for example {stem!r}); `ggufq models` lists names"
        )
    if _CONTROL.search(name):
        raise InvalidRequest(
            f"model name {name!r} holds a control character (a newline or tab, often from a "
            "file or a shell variable); names cannot hold control characters: strip it"
        )
    if not _MODEL_NAME.fullmatch(name):
        raise InvalidRequest(
            f"model name {name!r} is not valid; names use letters, digits, '.', '_' and '-' "
            "(at most 128); `ggufq models` lists the available names"
        )
    return name
