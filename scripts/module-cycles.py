#!/usr/bin/env python3
"""Module dependency cycles inside a Rust crate (issue 34: "dependencies point one way").

    scripts/module-cycles.py actors/src kernels/model/src     # report; exit 1 if any cycle
    scripts/module-cycles.py --edges actors/src               # also print why (file: path) per edge

A module's dependencies are the `crate::…`, `super::…` and `self::…` paths its files name (use trees
and paths in code; comments and string literals ignored; `#[cfg(test)]` modules ignored, since test
code may reach anywhere). An edge from `a::b::c` to `a::d::e` is recorded between the siblings below
their common ancestor (`a::b` -> `a::d`): that is the layering the rule is about. A parent and its own
children referring to each other is not a cycle (a parent declares its children). Cycles are the
strongly-connected components with more than one module, at every level of the tree.
"""
import os
import re
import sys
from collections import defaultdict


def module_path(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    if rel and rel[0] == "bin":
        return None
    return tuple(rel)


def strip(text):
    """Removes comments, string and char literals and #[cfg(test)] items, keeping line count."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or text.startswith("'\\u{", i):
            j = text.find("'", i + 2)
            out.append("' '")
            i = j + 1
        else:
            out.append(c)
            i += 1
    code = "".join(out)
    # drop `#[cfg(test)] mod x { … }` and `#[cfg(test)] <item> { … }` bodies
    while True:
        m = re.search(r"#\[cfg\(test\)\]", code)
        if not m:
            break
        j = m.end()
        brace, semi = code.find("{", j), code.find(";", j)
        if semi >= 0 and (brace < 0 or semi < brace):
            code = code[:m.start()] + "\n" * code.count("\n", m.start(), semi) + code[semi + 1:]
            continue
        depth, k = 0, brace
        while k < len(code):
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        code = code[:m.start()] + "\n" * code.count("\n", m.start(), k) + code[k + 1:]
    return code


def use_paths(tree):
    """Expands a use tree (`a::{b, c::{d, e}}`) into paths."""
    tree = re.sub(r"\s+", "", tree)

    def expand(prefix, s):
        if "{" not in s:
            return [prefix + [p for p in s.split("::") if p]]
        head, rest = s.split("{", 1)
        inner = rest[:rest.rfind("}")]
        parts, depth, cur = [], 0, ""
        for ch in inner:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        base = prefix + [p for p in head.split("::") if p]
        return [q for part in parts if part for q in expand(base, part)]

    return expand([], tree)


def references(code):
    refs = []
    for m in re.finditer(r"\buse\s+([^;]+);", code):
        line = code.count("\n", 0, m.start()) + 1
        for p in use_paths(m.group(1)):
            p = [x.split(" as ")[0] for x in p]
            refs.append((line, p))
    body = re.sub(r"\buse\s+[^;]+;", lambda m: "\n" * m.group(0).count("\n"), code)
    for m in re.finditer(r"\b((?:crate|super|self)(?:::(?:super|\w+))+)", body):
        line = code.count("\n", 0, m.start()) + 1
        refs.append((line, m.group(1).split("::")))
    return refs


def resolve(module, is_mod_file, path, modules):
    """The module a path names (its longest existing prefix), or None for external crates."""
    if not path:
        return None
    if path[0] == "crate":
        cur, rest = (), path[1:]
    elif path[0] in ("super", "self"):
        cur = module
        rest = path
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                cur = cur[:-1]
            rest = rest[1:]
    else:
        return None
    target = cur
    for seg in rest:
        if target + (seg,) in modules:
            target = target + (seg,)
        else:
            break
    return target


def main(argv):
    show_edges = "--edges" in argv
    srcs = [a for a in argv if not a.startswith("--")]
    found = False
    for src in srcs:
        files = {}
        for root, _, names in os.walk(src):
            for name in names:
                if name.endswith(".rs"):
                    p = os.path.join(root, name)
                    mp = module_path(src, p)
                    if mp is not None:
                        files[p] = mp
        modules = set(files.values())
        for mp in list(modules):
            for k in range(len(mp)):
                modules.add(mp[:k])
        # inline `mod x { … }` blocks are rare here; files are the modules
        edges = defaultdict(list)
        for p, mp in sorted(files.items()):
            with open(p, encoding="utf-8") as f:
                code = strip(f.read())
            for line, ref in references(code):
                t = resolve(mp, p.endswith("mod.rs"), ref, modules)
                if t is None or t == mp:
                    continue
                k = 0
                while k < min(len(mp), len(t)) and mp[k] == t[k]:
                    k += 1
                if k == len(mp) or k == len(t):
                    continue  # ancestor <-> descendant
                a, b = mp[:k + 1], t[:k + 1]
                edges[(a, b)].append(f"{os.path.relpath(p, src)}:{line}: {'::'.join(ref)}")
        graph = defaultdict(set)
        for (a, b) in edges:
            graph[a].add(b)
        cycles = sccs(graph)
        name = lambda m: "::".join(m) or "crate"
        if cycles:
            found = True
            print(f"{src}: {len(cycles)} cycle(s)")
            for comp in cycles:
                print("  " + " <-> ".join(sorted(name(m) for m in comp)))
                if show_edges:
                    for (a, b), why in sorted(edges.items()):
                        if a in comp and b in comp:
                            print(f"    {name(a)} -> {name(b)}: {why[0]}" + (f" (+{len(why) - 1})" if len(why) > 1 else ""))
        else:
            print(f"{src}: no module cycles ({len(modules)} modules, {len(edges)} edges)")
    return 1 if found else 0


def sccs(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    nodes = set(graph) | {b for bs in graph.values() for b in bs}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
