"""What restore records in DEST beside the manifest (``.kiln-installed.json``), as a typed model.

Restore writes it last into the staged tree; a later restore reads it for the no-op, verify and
``kiln check`` for the folder's drift. It crosses processes (and kiln versions) through a file
anyone with write access to DEST can edit, so it is read as untrusted input: one that does not
validate is no complete install (restore installs again), never a crash or a no-op on a guess.
Fields a newer kiln adds are kept, as the manifest's are.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kiln.artifact.bundle import Name
from kiln.artifact.manifest import MAX_FILES, FileEntry, Sha256


class BundleChoice(BaseModel):
    """The bundle an installed artifact was chosen from, and the variant chosen: a repeat
    restore of the same bundle that would choose it again is a no-op."""

    model_config = ConfigDict(extra="allow")

    sha256: Sha256
    variant: Name


class InstallState(BaseModel):
    """One restore's record of what it installed in DEST."""

    model_config = ConfigDict(extra="allow")

    artifact_sha256: Sha256 = Field(description="the artifact's bytes unpacked")
    source: str | None = Field(None, description="where it was restored from, as given")
    restored: float | None = Field(None, description="when (Unix time)")
    bundle: BundleChoice | None = None
    stamp_ns: StrictInt | None = Field(
        None, ge=0, description="the install's newest file change (kiln.artifact.drift)"
    )
    # Files restore rewrote for DEST (kiln.artifact.relocate), as they were installed: at most
    # one per file the manifest lists.
    relocated: list[FileEntry] = Field(default_factory=list, max_length=MAX_FILES)
