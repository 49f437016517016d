"""Result files the commands write: checked before the work that fills them, written whole.

A benchmark or a simulation runs for minutes; a typo in `--out` must cost a second, not the
run. `writable` checks the path before anything starts (its folder exists and may be written,
it is not a folder itself) and names the flag; `write_json` writes strict JSON (NaN and inf
as null) to a temporary file beside the target and renames it over the target, so a reader
never sees half a report and a stale one is replaced in one step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from flexfloor.rollout.metrics import json_safe


def path_arg(text: str) -> str:
    """An argparse `type` for a path flag: an empty or blank path is refused (argparse names
    the flag), where `if args.out:` would take it as a flag not given and drop the output."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or folder name")
    return text


def writable(path: str, flag: str, ext: tuple[str, str] | None = None) -> str:
    """`path` as an absolute path, once a file can be written there; ValueError naming `flag`
    and the fix otherwise. `ext`: (extension, format) where the file is always of one format
    (".parquet", "Parquet"), so a name of another kind is refused. Nothing is left behind (a
    probe file is written and removed)."""
    out = os.path.abspath(path)
    if os.path.isdir(out):
        raise ValueError(f"{flag} {path}: is a folder; give the file to write")
    _writable_folder(path, flag, os.path.dirname(out))
    if ext is not None and os.path.splitext(out)[1].lower() != ext[0]:
        stem = os.path.splitext(path)[0] if os.path.splitext(path)[1] else path
        raise ValueError(f"{flag} {path}: the file is written as {ext[1]}; name it "
                         f"{stem}{ext[0]}")
    return out


def writable_folder(path: str, flag: str) -> str:
    """`path` as an absolute path, once a folder there may be written: it is one already, or
    its parent is one; ValueError naming `flag` and the fix otherwise. Nothing is left
    behind (a probe file is written and removed)."""
    out = os.path.abspath(path)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{flag} {path}: is a file; give a folder")
    _writable_folder(path, flag, out if os.path.isdir(out) else os.path.dirname(out))
    return out


def creatable_folder(path: str, flag: str) -> str:
    """`path` as an absolute path, once a folder there exists or can be made with its parents
    (`os.makedirs`): nothing on the way is a file and the nearest folder that exists may be
    written; ValueError naming `flag` and the fix otherwise. Nothing is left behind (a probe
    file is written and removed)."""
    out = os.path.abspath(path)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{flag} {path}: is a file; give a folder")
    nearest = out
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        raise ValueError(f"{flag} {path}: {nearest} is a file, so the folder cannot be made; "
                         "give another path")
    _writable_folder(path, flag, nearest)
    return out


def distinct(**paths) -> None:
    """ValueError naming the first two flags (keyword: flag without its dashes, `length_file`
    for --length-file; value: a path, or None where not given) that name one file, compared as
    real paths (a link, `./x` and an absolute path alike): one run's report, plot and input
    must not write over each other."""
    seen = {}
    for name, path in paths.items():
        if path is None:
            continue
        real, flag = os.path.realpath(path), "--" + name.replace("_", "-")
        if real in seen:
            raise ValueError(f"{seen[real]} and {flag} name the same file ({path}); give two "
                             "paths")
        seen[real] = flag


def _writable_folder(path: str, flag: str, folder: str) -> None:
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: {folder} is not a folder; give another path")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: folder {folder} does not exist; create it or give "
                         "another path")
    try:  # a real write: os.access says yes to root on a read-only mount
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".flexfloor-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: folder {folder} is not writable "
                         f"({e.strerror or e}); give another path") from None


def writable_image(path: str, flag: str) -> str:
    """`writable`, for a plot: also refused unless matplotlib writes its extension's format,
    found before the work, not after it. A path without an extension gets `.png`, the name
    matplotlib would write, so the path returned (and printed) is the file there."""
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {path}: is a folder; give the file to write")
    if not os.path.splitext(path)[1]:
        path += ".png"
    out = writable(path, flag)
    from matplotlib.figure import Figure

    formats = sorted(Figure().canvas.get_supported_filetypes())
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if ext and ext not in formats:
        raise ValueError(f"{flag} {path}: cannot write a .{ext} image; end it in one of "
                         f"{', '.join('.' + f for f in formats)}")
    return out


def stopped_line(tool: str, written, signum: int = 2) -> str:
    """The one line a tool ends with when a stop signal (`signum`, default SIGINT: Ctrl-C)
    ends its work: what it had written by then (`written`: paths), or that it wrote nothing
    (its files are written whole or not at all, so none is half there)."""
    import signal

    said = f"only {', '.join(written)} written" if written else "nothing written"
    return f"{tool}: stopped by {signal.Signals(signum).name}; {said}"


def write_whole(path: str, write) -> None:
    """`write(tmp)` writes the file at a temporary path beside `path`, then it is renamed over
    `path`: the file is there whole or not at all (an earlier one stays until then)."""
    tmp = f"{path}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, report) -> None:
    """`report` as strict JSON (indented) at `path`, whole or not at all."""

    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(json_safe(report), f, indent=1)

    write_whole(path, dump)
