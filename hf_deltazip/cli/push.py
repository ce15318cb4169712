"""``deltazip push``."""

from __future__ import annotations

import json

from ..errors import DeltaZipError


def _quality(text: str) -> dict:
    try:
        quality = json.loads(text)
    except json.JSONDecodeError as e:
        raise DeltaZipError(f"--quality is not JSON ({e}): pass an object such as '{{\"gain_kept\": 0.97}}'") from None
    if not isinstance(quality, dict):
        raise DeltaZipError(f"--quality must be a JSON object of figures such as '{{\"gain_kept\": 0.97}}', got {text!r}")
    return quality


def cmd_push(args) -> int:
    from ..hub import push_delta_folder

    quality = _quality(args.quality) if args.quality else None
    info = push_delta_folder(args.folder, args.repo_id, private=args.private or None, revision=args.revision,
                             commit_message=args.message, token=args.token, quality=quality)
    print(f"pushed {args.folder} to {args.repo_id}: commit {info.oid}")
    if getattr(info, "commit_url", None):
        print(info.commit_url)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("push", help="upload a delta folder to the Hub with a generated model card")
    p.add_argument("folder", help="a delta folder (deltazip_config.json + delta.dz)")
    p.add_argument("repo_id", help="org/name")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", help="branch to push to (created if missing)")
    p.add_argument("--message", help="commit message")
    p.add_argument("--token", help="Hub token (default: saved login or HF_TOKEN)")
    p.add_argument("--quality", help='quality figures for the card as JSON, e.g. \'{"gain_kept": 0.97}\'')
    p.set_defaults(func=cmd_push)
