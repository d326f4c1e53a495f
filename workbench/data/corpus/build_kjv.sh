#!/usr/bin/env bash
# How kjv.txt.gz was made (a one-off, kept for provenance; the workbench never runs it).
# Needs Debian's bible-kjv (the `bible` retrieval program) and bible-kjv-text (its data), 4.38.
set -euo pipefail
work="$(mktemp -d)"
cd "$work"
apt-get download bible-kjv bible-kjv-text
for deb in *.deb; do dpkg -x "$deb" root; done
# pretty-printed output: a "Book N" title line per chapter, then "  V text" per verse
./root/usr/bin/bible -p "$PWD/root/usr/lib" -l 100000 "Gen1:1-Rev22:21" </dev/null > pretty.txt
python3 - <<'PY'
import re
docs, cur = [], None
for line in open("pretty.txt", encoding="utf-8").read().split("\n"):
    if not line.strip():
        continue
    m = re.match(r"^  (\d+) (.*)$", line)
    if m:
        cur.append(f"{m.group(1)} {m.group(2).strip()}")
    else:
        cur = [line.strip()]
        docs.append(cur)
open("kjv.txt", "w", encoding="utf-8").write("\n\n".join("\n".join(d) for d in docs) + "\n")
print(len(docs), "chapters")
PY
gzip -9 -n kjv.txt
echo "$work/kjv.txt.gz"
