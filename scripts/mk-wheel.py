#!/usr/bin/env python3
"""Build the Python SDK's pure-Python wheel with the standard library only.

    scripts/mk-wheel.py PYTHON_DIR OUT_DIR   -> prints the wheel's path

A wheel is a zip archive (PEP 427): the package files, then
NAME-VERSION.dist-info/{METADATA,WHEEL,RECORD}. Writing it here needs
neither the network nor the `wheel` package, which Debian's offline
setuptools (66) requires for `pip install ./python` and `bdist_wheel`.
Timestamps and file order are fixed, so the same sources give the same bytes.
"""
import base64
import hashlib
import os
import sys
import tomllib
import zipfile

EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip can hold


def record_hash(data):
    d = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + d.decode()


def metadata(project, readme):
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
        f"Summary: {project.get('description', '')}",
    ]
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    lic = project.get("license", {})
    if isinstance(lic, dict) and "text" in lic:
        lines.append(f"License: {lic['text']}")
    lines += [f"Classifier: {c}" for c in project.get("classifiers", [])]
    lines += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
    if readme is not None:
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + readme
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: mk-wheel.py PYTHON_DIR OUT_DIR")
    src, out = sys.argv[1], sys.argv[2]
    with open(os.path.join(src, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    project = pyproject["project"]
    setup = pyproject.get("tool", {}).get("setuptools", {})
    name, version = project["name"], project["version"]
    dist = name.replace("-", "_")
    readme = None
    if isinstance(project.get("readme"), str):
        with open(os.path.join(src, project["readme"]), encoding="utf-8") as f:
            readme = f.read()

    files = []  # (archive name, bytes)
    for pkg in setup.get("packages", [name]):
        extra = setup.get("package-data", {}).get(pkg, [])
        pdir = os.path.join(src, *pkg.split("."))
        for fn in sorted(os.listdir(pdir)):
            if fn.endswith(".py") or fn in extra:
                with open(os.path.join(pdir, fn), "rb") as f:
                    files.append((pkg.replace(".", "/") + "/" + fn, f.read()))

    info = f"{dist}-{version}.dist-info"
    wheel_meta = "Wheel-Version: 1.0\nGenerator: warren mk-wheel.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files.append((f"{info}/METADATA", metadata(project, readme).encode()))
    files.append((f"{info}/WHEEL", wheel_meta.encode()))
    record = "".join(f"{n},{record_hash(d)},{len(d)}\n" for n, d in files)
    record += f"{info}/RECORD,,\n"
    files.append((f"{info}/RECORD", record.encode()))

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{dist}-{version}-py3-none-any.whl")
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files:
            zi = zipfile.ZipInfo(n, EPOCH)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, d)
    os.replace(tmp, path)
    print(path)


if __name__ == "__main__":
    main()
