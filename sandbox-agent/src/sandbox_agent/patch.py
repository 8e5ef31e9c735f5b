"""Apply unified diffs (``diff -u`` / ``git diff``) to the workspace.

All hunks of all files are checked before anything is written, so a conflict
leaves the workspace untouched. A hunk may have drifted (the file changed
above it); the nearest exact match of its old lines is used, as patch(1)
does without fuzz.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from . import files, models
from .config import Settings
from .errors import Conflict, Invalid, TooLarge
from .paths import Workspace

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    old_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    old_noeol: bool = False
    new_noeol: bool = False


@dataclass
class FilePatch:
    old_path: str
    new_path: str
    hunks: list[Hunk] = field(default_factory=list)


def _header_path(line: str) -> str:
    # "--- a/x\t2024-01-01 ..." : the timestamp after a tab is not part of the name
    p = line[4:].split("\t", 1)[0].rstrip("\r")
    if p.startswith('"') and p.endswith('"') and len(p) > 1:
        p = p[1:-1]
    return p


def _file_header(lines: list[str], i: int) -> bool:
    return lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")


def _stray(lines: list[str], i: int) -> bool:
    """A changed line where only a header, prose or the next hunk may follow
    (`-- ` is the signature line of `git format-patch`)."""
    line = lines[i]
    return line[:1] in ("+", "-") and line not in ("--", "-- ") and not _file_header(lines, i)


def parse(text: str) -> list[FilePatch]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    out: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _file_header(lines, i):
            fp = FilePatch(_header_path(line), _header_path(lines[i + 1]))
            out.append(fp)
            i += 2
            continue
        m = _HUNK.match(line)
        if line.startswith("@@") and not m:
            # Skipping it would apply the other hunks and report success.
            raise Invalid(
                "invalid_patch",
                f"malformed hunk header at line {i + 1}: {line!r}"
                " (expected '@@ -START[,COUNT] +START[,COUNT] @@')",
            )
        if m:
            if not out:
                raise Invalid("invalid_patch", f"hunk before any file header (line {i + 1})")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(int(m.group(1)))
            i += 1
            seen_old = seen_new = 0
            last = ""
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                body = lines[i]
                tag, rest = (body[:1], body[1:]) if body else (" ", "")
                if tag == " ":
                    hunk.old.append(rest)
                    hunk.new.append(rest)
                    seen_old += 1
                    seen_new += 1
                elif tag == "-":
                    hunk.old.append(rest)
                    seen_old += 1
                elif tag == "+":
                    hunk.new.append(rest)
                    seen_new += 1
                elif tag == "\\":
                    # "\ No newline at end of file" qualifies the line above it
                    hunk.old_noeol |= last in (" ", "-")
                    hunk.new_noeol |= last in (" ", "+")
                    i += 1
                    continue
                else:
                    raise Invalid("invalid_patch", f"unexpected line {i + 1} in hunk: {body!r}")
                last = tag
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise Invalid("invalid_patch", "hunk is shorter than its header says")
            # "\ No newline at end of file" refers to the line just above it.
            while i < len(lines) and lines[i].startswith("\\"):
                if last in (" ", "-"):
                    hunk.old_noeol = True
                if last in (" ", "+"):
                    hunk.new_noeol = True
                i += 1
            if i < len(lines) and _stray(lines, i):
                # The header counted fewer lines than the hunk has: applying the
                # counted part would silently drop the rest.
                raise Invalid(
                    "invalid_patch",
                    f"line {i + 1} ({lines[i]!r}) follows a hunk its header says is"
                    " complete: the header's line counts are wrong",
                )
            out[-1].hunks.append(hunk)
            continue
        i += 1  # "diff --git", "index", mode lines and prose are ignored
    if not out:
        raise Invalid("invalid_patch", "no file headers (--- / +++) found in the patch")
    return out


def _strip(path: str, n: int) -> str:
    parts = path.split("/")
    if n >= len(parts):
        raise Invalid("invalid_patch", f"cannot strip {n} components from {path!r}")
    return "/".join(parts[n:])


def _find(lines: list[bytes], old: list[bytes], expected: int, lo: int) -> int:
    """Index where ``old`` occurs in ``lines`` at or after ``lo``, nearest to ``expected``."""
    if not old:
        return min(max(expected, lo), len(lines))
    best = -1
    for start in range(lo, len(lines) - len(old) + 1):
        if lines[start : start + len(old)] == old and (
            best < 0 or abs(start - expected) < abs(best - expected)
        ):
            best = start
    return best


def _encoded(lines: list[str], rel: str) -> list[bytes]:
    try:
        return [line.encode("utf-8") for line in lines]
    except UnicodeEncodeError:
        raise Invalid("invalid_patch", f"the patch of {rel} is not valid Unicode") from None


def apply(ws: Workspace, req: models.PatchRequest, s: Settings) -> models.PatchResult:
    # A patched file is held in memory whole, as a list of its lines (bytes: a
    # decoded str of one astral character is four bytes per character), so
    # both its size and its number of lines are bounded by the memory budget.
    max_bytes = files.edit_limit(s)
    max_lines = max_bytes // 64
    if req.patch.count("\n") > max_lines:
        raise TooLarge(
            "patch_too_large",
            f"the patch has more than {max_lines} lines (an edit holds at most that many)",
            limit=max_lines,
        )
    patches = parse(req.patch)
    results: list[models.PatchedFile] = []
    writes: list[tuple[str, bytes | None, int | None]] = []
    for fp in patches:
        creating = fp.old_path == "/dev/null"
        deleting = fp.new_path == "/dev/null"
        strip = req.strip
        if strip is None:
            a, b = fp.old_path, fp.new_path
            strip = (
                1
                if (a.startswith("a/") or creating)
                and (b.startswith("b/") or deleting)
                and not (creating and deleting)
                else 0
            )
        rel = _strip(fp.old_path if deleting else fp.new_path, strip)
        if not fp.hunks and not (creating or deleting):
            raise Invalid("invalid_patch", f"the patch of {rel} has no hunks: nothing to apply")
        if creating:
            with files.os_errors(rel), ws.locate(rel, follow=False) as loc:
                try:
                    os.stat(loc.name, dir_fd=loc.dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    raise Conflict("patch_conflict", f"{rel} already exists", path=rel)
            lines: list[bytes] = []
            eol = True
            mode = None
        else:
            raw = files.read_all(ws, rel, max_bytes)
            files.require_utf8(raw, rel)
            if raw.count(b"\n") > max_lines:
                raise TooLarge(
                    "patch_too_large",
                    f"{rel} has more than {max_lines} lines, the most a patch edits",
                    limit=max_lines,
                )
            eol = raw.endswith(b"\n") or raw == b""
            lines = raw.split(b"\n")
            del raw
            if eol:
                lines.pop()
            mode = None
        offset = 0
        floor = 0
        for n, h in enumerate(fp.hunks, start=1):
            old, new = _encoded(h.old, rel), _encoded(h.new, rel)
            expected = max(h.old_start - 1, 0) + offset if h.old else h.old_start + offset
            at = _find(lines, old, expected, floor)
            if at < 0:
                raise Conflict(
                    "patch_conflict",
                    f"hunk {n} of {rel} does not apply: its context was not found",
                    path=rel,
                    hunk=n,
                    expectedLine=h.old_start,
                    expected="\n".join(h.old[:20]),
                )
            touches_end = at + len(h.old) == len(lines)
            if touches_end and h.old and h.old_noeol == eol:
                raise Conflict(
                    "patch_conflict",
                    f"hunk {n} of {rel} disagrees about the newline at end of file",
                    path=rel,
                    hunk=n,
                )
            lines[at : at + len(old)] = new
            if touches_end:
                eol = not h.new_noeol
            offset += len(h.new) - len(h.old)
            floor = at + len(h.new)
        if deleting:
            if lines:
                raise Conflict(
                    "patch_conflict", f"{rel} is not empty after removing its lines", path=rel
                )
            writes.append((rel, None, None))
            results.append(models.PatchedFile(path=rel, status="deleted", hunks=len(fp.hunks)))
            continue
        body = b"\n".join(lines) + (b"\n" if eol and lines else b"")
        del lines
        writes.append((rel, body, mode))
        results.append(
            models.PatchedFile(
                path=rel, status="created" if creating else "modified", hunks=len(fp.hunks)
            )
        )
    if not req.dry_run:
        for rel, data, mode in writes:
            if data is None:
                try:
                    with ws.locate(rel, follow=False) as loc:
                        os.unlink(loc.name, dir_fd=loc.dir_fd)
                except OSError as exc:
                    raise Conflict("patch_conflict", f"cannot delete {rel}: {exc}") from None
            else:
                files.write_bytes(ws, rel, data, mode, parents=True)
    return models.PatchResult(files=results, dry_run=req.dry_run)
