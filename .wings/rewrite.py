"""Rewrite references to moved `app` modules across the repository (issue 23, wings).

Usage: `python .wings/rewrite.py [--check]` from the repository root (or anywhere).
The mapping is `.wings/moves.txt` (`old.module new.module`; `dir:old/path new/path`).

What it rewrites, in every tracked text file (Python, TOML, Markdown, Makefile,
Dockerfile, YAML, INI, shell, Mako, HTML, JS, CSS):

- `from app import x, y as z` -> one `from <package> import <leaf> [as x]` line per package,
  keeping the local name (`from app import routes_console` -> `from app.console import pages
  as routes_console`);
- every dotted reference `app.x` (imports, `import app.x`, `app.x.attr`, strings such as
  `importlib.import_module("app.x")`, `"app.x:main"` entry points, monkeypatch targets, logger
  names) -> `app.new.x`; a reference that already names a new module is left alone;
- file paths `app/x.py` -> `app/new/x.py` and moved directories (`app/static/...`).

It is idempotent: a second run changes nothing (run it after merging other branches), and
`--check` says what it would change. Afterwards run `ruff check --fix --select I .` (import
order) and `ruff format .`, and wrap any comment line a longer path pushed past 100 columns.
Not covered: a name that moved without its module (`install_console` went from app.console
to app.console.install; `signed_form` from the Twilio routes to app.http.signatures;
the demos' shared helpers moved to app.cli.demo_harness): fix those by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUFFIXES = {
    ".py",
    ".toml",
    ".md",
    ".cfg",
    ".ini",
    ".yaml",
    ".yml",
    ".sh",
    ".mako",
    ".txt",
    ".html",
    ".js",
    ".css",
    ".json",
    ".env",
    ".conf",
}
NAMES = {"Makefile", "Dockerfile", "run"}
SKIP = {".wings/moves.txt", ".wings/rewrite.py"}


def load() -> tuple[dict[str, str], dict[str, str]]:
    modules: dict[str, str] = {}
    dirs: dict[str, str] = {}
    for raw in (HERE / "moves.txt").read_text("utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        old, new = line.split()
        if old.startswith("dir:"):
            dirs[old[4:]] = new
        else:
            modules[old] = new
    return modules, dirs


def rewriter(modules: dict[str, str], dirs: dict[str, str]):
    new_names = set(modules.values())
    olds = sorted(modules, key=len, reverse=True)
    dotted = re.compile(r"(?<![\w.])(" + "|".join(re.escape(o) for o in olds) + r")(?![\w])")
    leaves = {o.split(".", 1)[1]: o for o in olds}  # "calls" -> "app.calls"
    from_app = re.compile(r"^(?P<indent>[ \t]*)from app import (?P<names>\([^)]*\)|[^\n]+)$", re.M)
    paths = {o.replace(".", "/") + ".py": n.replace(".", "/") + ".py" for o, n in modules.items()}
    path_re = re.compile(
        r"(?<![\w/.])("
        + "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
        + r")(?![\w])"
    )
    dir_re = (
        re.compile(r"(?<![\w/.])(" + "|".join(re.escape(d) for d in dirs) + r")(?=/|\b)")
        if dirs
        else None
    )

    def fix_from_app(m: re.Match[str]) -> str:
        indent = m.group("indent")
        body = m.group("names").strip()
        comment = ""
        if not body.startswith("(") and "#" in body:
            body, comment = body.split("#", 1)
            body, comment = body.strip(), "  #" + comment
        names = [n.strip() for n in body.strip("()").replace("\n", " ").split(",") if n.strip()]
        if not any(n.split(" as ")[0].strip() in leaves for n in names):
            return m.group(0)
        groups: dict[str, list[str]] = {}
        for n in names:
            name, _, alias = (p.strip() for p in n.partition(" as "))
            local = alias or name
            old = leaves.get(name)
            if old is None:
                groups.setdefault("app", []).append(n)
                continue
            package, _, leaf = modules[old].rpartition(".")
            groups.setdefault(package, []).append(leaf if leaf == local else f"{leaf} as {local}")
        lines = [
            f"{indent}from {package} import {', '.join(sorted(items))}"
            for package, items in sorted(groups.items())
        ]
        lines[0] += comment
        return "\n".join(lines)

    # `app.calls`, `app.console` and `app.cli` were modules and are now packages. Such a name
    # is rewritten only where it means the old module: `from app.calls import CallRegistry`
    # and `app.calls.CallRegistry` (an attribute), `"app.cli:main"`, `import app.calls`. A
    # submodule after it (`from app.calls import store`, `app.calls.store`, whatever the
    # package holds on disk or in moves.txt), a bare name (`"app.console"`: a package name now)
    # and `python -m app.cli` (the package's __main__) are left alone.
    packages: dict[str, set[str]] = {}
    for n in new_names:
        parent, _, leaf = n.rpartition(".")
        packages.setdefault(parent, set()).add(leaf)
    for package, leaves_of in packages.items():
        folder = ROOT.joinpath(*package.split("."))
        if folder.is_dir():
            leaves_of.update(p.stem for p in folder.glob("*.py"))
            leaves_of.update(p.name for p in folder.iterdir() if (p / "__init__.py").is_file())
    from_pkg = re.compile(r"[ \t]*from\s+([\w.]+)\s+import\s+(\([^)]*\)|[^\n#]+)")
    import_pkg = re.compile(r"[ \t]*import\s+[\w.]+")

    def package_means_old(old: str, text: str, at: int) -> bool:
        end = at + len(old)
        line_start = text.rfind("\n", 0, at) + 1
        stmt = from_pkg.match(text, line_start)
        if stmt is not None and stmt.start(1) == at and stmt.group(1) == old:
            names = [n.split(" as ")[0].strip() for n in stmt.group(2).strip("()").split(",")]
            return not all(n in packages[old] for n in names if n)
        after = text[end : end + 1]
        if after == ".":
            leaf = re.match(r"\w+", text[end + 1 :])
            return leaf is not None and leaf.group(0) not in packages[old]
        if after == ":":
            return True
        if re.search(r"-m[\"',\s]*$", text[max(0, at - 40) : at]):
            return False
        return import_pkg.match(text, line_start) is not None

    def fix_dotted(m: re.Match[str]) -> str:
        old, at = m.group(1), m.start()
        if old in packages and not package_means_old(old, m.string, at):
            return m.group(0)
        return modules[old]

    def fix_path(m: re.Match[str]) -> str:
        return paths[m.group(1)]

    def run(text: str) -> str:
        text = from_app.sub(fix_from_app, text)
        text = dotted.sub(fix_dotted, text)
        text = path_re.sub(fix_path, text)
        if dir_re is not None:
            text = dir_re.sub(lambda m: dirs[m.group(1)], text)
        return text

    return run


def files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    found = []
    for rel in filter(None, out.split("\0")):
        p = ROOT / rel
        if rel in SKIP or not p.is_file():
            continue
        if p.suffix in SUFFIXES or p.name in NAMES:
            found.append(p)
    return found


def main() -> int:
    check = "--check" in sys.argv
    run = rewriter(*load())
    changed = []
    for p in files():
        try:
            old = p.read_text("utf-8")
        except UnicodeDecodeError:
            continue
        new = run(old)
        if new != old:
            changed.append(p.relative_to(ROOT))
            if not check:
                p.write_text(new, "utf-8")
    for c in changed:
        print(("would rewrite " if check else "rewrote ") + str(c))
    return 1 if (check and changed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
