#!/usr/bin/env python3
"""Lines of code in src/**/*.rs: non-blank lines that are not comments
(// ... , ///, //!, or inside /* */), excluding `#[cfg(test)]` items
(a `mod tests { ... }` block or any item right after #[cfg(test)],
skipped by brace matching)."""
import sys, pathlib, re
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "src")
total = 0
per = {}
for f in sorted(root.rglob("*.rs")):
    lines = f.read_text().splitlines()
    n = 0; i = 0; inblock = False
    while i < len(lines):
        s = lines[i].strip()
        if inblock:
            if "*/" in s: inblock = False
            i += 1; continue
        if s.startswith("/*"):
            inblock = "*/" not in s; i += 1; continue
        if s == "#[cfg(test)]":
            # skip the attribute and the item after it, braces matched
            j = i + 1
            depth = 0; opened = False
            while j < len(lines):
                t = re.sub(r'"(\\.|[^"\\])*"', '""', lines[j])
                t = t.split("//")[0]
                depth += t.count("{") - t.count("}")
                if "{" in t: opened = True
                if (opened and depth <= 0) or (not opened and t.strip().endswith(";")):
                    break
                j += 1
            i = j + 1; continue
        if s and not s.startswith("//"):
            n += 1
        i += 1
    per[str(f)] = n; total += n
if "-v" in sys.argv:
    for k, v in sorted(per.items(), key=lambda kv: -kv[1]): print(v, k)
print(total)
