//! Assembles the Redis decision library from `lua/` into `$OUT_DIR/library.lua`
//! (see `src/store/redis/script.rs`), expanding its step blocks.
//!
//! Each algorithm's steps are written once, in its Lua file, on local
//! variables, between directive lines (comments to Lua):
//!
//! ```text
//! --: state gcra: key written tat frac     the algorithm's state, by name
//! --: params gcra: b n w                   s[2], s[3], ... of its spec
//! --: stored gcra G: r_level r_den+ written the STRING it keeps: a tag byte,
//!                                          then doubles (`+`: positive)
//! --: step gcra earliest(now, cost) -> t   a step: its arguments, its results
//!   ...                                    (no `return`: it assigns results)
//! --: end
//! --: one gcra                             the algorithm's table goes here
//! ```
//!
//! A step becomes a function over a state table, `gcra_earliest(st, s, now,
//! cost)`, which the driver's loop over several limits calls. `--: stored`
//! writes the `load(keys, i, v)` step: it reads the key (unless given its
//! value `v`), and sets `raw` when the value has the tag, the length and
//! fields that are integers below 2^53 in magnitude, else `written` to 0.
//! `--: one gcra` becomes `gcra_one`, an instance of the driver's `--:
//! template one` with the steps pasted in where it says `--: inline
//! earliest(now, cost) -> t`, each in a `do ... end` block, on locals: the
//! same code without a call or a table access per step, for the decision of
//! one limit, the common case (`STORED` in the template: `true` for an
//! algorithm with `--: stored`, else `false`); then
//! `local gcra = { load = gcra_load, ..., one = gcra_one }` (`--: one tb
//! token_bucket` names the table). Arguments and results are bound by name,
//! so a template and a step that disagree fail the build. The template's
//! instances come before `lua/wire.lua`'s locals are in scope: its
//! integer constants (`local A, B = 1, 2` there, written from
//! `src/algorithm/wire.rs`) are pasted into them as literals (a literal is
//! an operand, an upvalue must be loaded first).
//!
//! A piece of a step that several steps share, written once without the
//! cost of a call:
//!
//! ```text
//! --: fragment window(t, u, w) -> ws, wb    defined before its first use
//!   ...                                     (assigns its results)
//! --: end
//! --: paste window(at, u, w) -> ws, wb      in a step: the fragment's body
//! ```
//!
//! A paste becomes the fragment's body in a `do ... end` block, each
//! parameter named by its argument (`t` written `at`: the arguments are
//! names, and nothing is bound at run time); its results are the caller's
//! locals of those names (the same names, or the build fails). (Plain Lua
//! functions in their place cost a fixed window's decision 1.4 to 1.8 %
//! more Redis instructions, a sliding window's 2.3 to 2.9 %: `CALLGRIND=1
//! bench/lua.sh`.)
//!
//! Every block the build writes or splices names its source in a comment,
//! `-- lua/gcra.lua:60 earliest` (the directive's file and line), and
//! `$OUT_DIR/library_lines.rs` maps each line of the library back to the
//! line of `lua/` it came from (a line the build writes: its directive's),
//! so that an error Redis reports at a line of the library names the source
//! (see `src/store/redis/script.rs`).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

/// The library's files after the algorithms', in the order Redis reads them.
const FILES: [&str; 8] = [
    "wire", "driver", "kept", "penalty", "limits", "one", "fleet", "dispatch",
];

/// The library's files, in the order Redis reads them: `common`, then each
/// algorithm's of `lua/wire.lua`'s list (written from the registry in
/// `src/algorithm/mod.rs`), `<name>.lua`, then [`FILES`].
fn files(dir: &str) -> Vec<String> {
    let wire = std::fs::read_to_string(format!("{dir}/lua/wire.lua")).expect("lua/wire.lua");
    let list = wire
        .lines()
        .find_map(|line| line.strip_prefix("local algorithms = {")?.strip_suffix('}'))
        .expect("lua/wire.lua lists the algorithms");
    let mut files = vec!["common".to_owned()];
    files.extend(list.split(',').map(|name| name.trim().to_owned()));
    files.extend(FILES.map(str::to_owned));
    files
}

/// A line of the library, as the line (0-based) of the concatenated
/// sources that it came from: the line itself, or the directive that wrote it.
type Line = (usize, String);

struct Step {
    /// The directive's line.
    at: usize,
    args: Vec<String>,
    outs: Vec<String>,
    body: Vec<Line>,
}

#[derive(Default)]
struct Algorithm {
    /// Its state is one STRING (`--: stored`).
    stored: bool,
    state: Vec<String>,
    params: Vec<String>,
    steps: HashMap<String, Step>,
}

/// The library being written: its text, and for each of its lines the
/// line of the sources it came from.
struct Out<'a> {
    text: String,
    origins: Vec<usize>,
    /// `lua/<file>.lua:<line>` of a line of the sources.
    source: &'a dyn Fn(usize) -> String,
}

impl Out<'_> {
    fn line(&mut self, origin: usize, line: &str) {
        self.text.push_str(line);
        self.text.push('\n');
        self.origins.push(origin);
    }
}

fn main() {
    println!("cargo:rerun-if-changed=lua");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let mut source = String::new();
    // where each file starts in `source`, in lines
    let mut starts = Vec::new();
    let files = files(&dir);
    for file in &files {
        println!("cargo:rerun-if-changed=lua/{file}.lua");
        let path = format!("{dir}/lua/{file}.lua");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        starts.push(source.lines().count());
        source.push_str(&text);
    }
    // the file (its index) and line (from 1) of a line (0-based) of `source`
    let place = |line: usize| {
        let k = starts.iter().rposition(|start| *start <= line).unwrap_or(0);
        (k, line - starts[k] + 1)
    };
    let name = |line: usize| {
        let (k, n) = place(line);
        format!("lua/{}.lua:{n}", files[k])
    };
    let mut out = Out {
        text: String::with_capacity(source.len() * 2),
        origins: Vec::new(),
        source: &name,
    };
    expand(&source, &mut out).unwrap_or_else(|(line, e)| panic!("{}: {e}", name(line)));
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    std::fs::write(format!("{out_dir}/library.lua"), &out.text).expect("write library.lua");
    let mut lines = String::new();
    let _ = writeln!(
        lines,
        "/// The files of `lua/` the library is assembled from.\n\
         pub(crate) const LUA_FILES: [&str; {}] = [{}];\n\
         /// Each line of the library (the first: line 1) as the line of\n\
         /// `lua/` it came from: its file in `LUA_FILES`, and its line.\n\
         pub(crate) const LUA_LINES: [(u8, u16); {}] = [",
        files.len(),
        files
            .iter()
            .map(|f| format!("{f:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        out.origins.len(),
    );
    for origin in &out.origins {
        let (k, n) = place(*origin);
        let k = u8::try_from(k).expect("fewer than 256 files");
        let n = u16::try_from(n).expect("files under 65536 lines");
        let _ = write!(lines, "({k}, {n}),");
    }
    lines.push_str("];\n");
    std::fs::write(format!("{out_dir}/library_lines.rs"), lines).expect("write library_lines.rs");
}

/// `name(a, b) -> x, y` as ("name", [a, b], [x, y]).
fn signature(text: &str) -> Result<(String, Vec<String>, Vec<String>), String> {
    let (call, outs) = match text.split_once("->") {
        Some((call, outs)) => (call, names(outs)),
        None => (text, Vec::new()),
    };
    let (name, args) = call
        .trim()
        .strip_suffix(')')
        .and_then(|c| c.split_once('('))
        .ok_or_else(|| format!("`{text}`: expected name(arguments)"))?;
    Ok((name.trim().to_owned(), names(args), outs))
}

fn names(list: &str) -> Vec<String> {
    list.split([',', ' '])
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The directive of a line (its text after `--:`), if it is one.
fn directive(line: &str) -> Option<&str> {
    line.trim_start().strip_prefix("--:").map(str::trim)
}

/// The lines up to `--: end` after line `i`, and the index of that line.
fn block(lines: &[&str], i: usize) -> Result<(Vec<Line>, usize), (usize, String)> {
    let mut body = Vec::new();
    for (j, line) in lines.iter().enumerate().skip(i + 1) {
        match directive(line) {
            Some("end") => return Ok((body, j)),
            Some(other)
                if !other.starts_with("inline")
                    && !other.starts_with("paste")
                    && other != "locals" =>
            {
                return Err((j, format!("`--: {other}` inside a block")))
            }
            _ => body.push((j, (*line).to_owned())),
        }
    }
    Err((i, "a block without `--: end`".to_owned()))
}

/// The library: `source` with its directives expanded, into `out`; an
/// error names the line (0-based) of the directive it concerns.
fn expand(source: &str, out: &mut Out) -> Result<(), (usize, String)> {
    let lines: Vec<&str> = source.lines().collect();
    // First pass: every algorithm's state, parameters and steps, and the
    // templates, wherever they are.
    let mut algorithms: HashMap<String, Algorithm> = HashMap::new();
    let mut templates: HashMap<String, (usize, Vec<Line>)> = HashMap::new();
    let mut constants: HashMap<String, String> = HashMap::new();
    let mut fragments: HashMap<String, Step> = HashMap::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(d) = directive(lines[i]) else {
            constant(lines[i], &mut constants);
            i += 1;
            continue;
        };
        let (word, rest) = d.split_once(' ').unwrap_or((d, ""));
        match word {
            "stored" => {
                let (head, list) = rest
                    .split_once(':')
                    .ok_or_else(|| (i, "`--: stored alg T: fields`".to_owned()))?;
                let (alg, tag) = head
                    .trim()
                    .split_once(' ')
                    .ok_or_else(|| (i, "`--: stored alg T: fields`".to_owned()))?;
                let a = algorithms.entry(alg.to_owned()).or_default();
                a.stored = true;
                a.steps.insert(
                    "load".to_owned(),
                    load(i, tag.trim(), &names(list)).map_err(|e| (i, e))?,
                );
            }
            "state" | "params" => {
                let (alg, list) = rest
                    .split_once(':')
                    .ok_or_else(|| (i, format!("`--: {word} alg: names`")))?;
                let a = algorithms.entry(alg.trim().to_owned()).or_default();
                let target = if word == "state" {
                    &mut a.state
                } else {
                    &mut a.params
                };
                *target = names(list);
            }
            "step" => {
                let (alg, sig) = rest
                    .split_once(' ')
                    .ok_or_else(|| (i, "`--: step alg name(...)`".to_owned()))?;
                let (name, args, outs) = signature(sig).map_err(|e| (i, e))?;
                let (body, end) = block(&lines, i)?;
                let body = paste(body, &fragments, out.source).map_err(|e| (i, e))?;
                if let Some((_, line)) = body
                    .iter()
                    .find(|(_, l)| l.trim_start().starts_with("return"))
                {
                    return Err((
                        i,
                        format!(
                            "step {alg} {name}: `{}`: a step assigns its results",
                            line.trim()
                        ),
                    ));
                }
                let a = algorithms.entry(alg.to_owned()).or_default();
                a.steps.insert(
                    name,
                    Step {
                        at: i,
                        args,
                        outs,
                        body,
                    },
                );
                i = end;
            }
            "template" => {
                let (body, end) = block(&lines, i)?;
                templates.insert(rest.to_owned(), (i, body));
                i = end;
            }
            "fragment" => {
                let (name, args, outs) = signature(rest).map_err(|e| (i, e))?;
                let (body, end) = block(&lines, i)?;
                let step = Step {
                    at: i,
                    args,
                    outs,
                    body,
                };
                fragments.insert(name, step);
                i = end;
            }
            "one" | "end" | "locals" | "inline" | "paste" => {}
            _ => return Err((i, format!("unknown directive `--: {d}`"))),
        }
        i += 1;
    }

    // Second pass: steps become functions over a state table, `--: one`
    // the template's instance, the other directives go.
    let mut i = 0;
    while i < lines.len() {
        let Some(d) = directive(lines[i]) else {
            out.line(i, lines[i]);
            i += 1;
            continue;
        };
        let (word, rest) = d.split_once(' ').unwrap_or((d, ""));
        match word {
            "step" => {
                let (alg, sig) = rest.split_once(' ').unwrap_or((rest, ""));
                let (name, _, _) = signature(sig).map_err(|e| (i, e))?;
                let a = &algorithms[alg];
                function(out, alg, &name, a);
                i = block(&lines, i)?.1;
            }
            "template" | "fragment" => i = block(&lines, i)?.1,
            "stored" => {
                let alg = rest.split(' ').next().unwrap_or_default();
                function(out, alg, "load", &algorithms[alg]);
            }
            "one" => {
                let (alg, table) = rest.split_once(' ').unwrap_or((rest, rest));
                let a = algorithms
                    .get(alg)
                    .ok_or_else(|| (i, format!("`--: one {alg}`: no such algorithm")))?;
                let template = templates
                    .get("one")
                    .ok_or_else(|| (i, "`--: one` without `--: template one`".to_owned()))?;
                let here = (out.source)(i);
                out.line(
                    i,
                    &format!(
                        "-- {} template one, for {alg} ({here} one {alg})",
                        (out.source)(template.0)
                    ),
                );
                instance(out, alg, a, &template.1, &constants).map_err(|e| (i, e))?;
                let mut steps: Vec<&String> = a.steps.keys().collect();
                steps.sort();
                out.line(i, &format!("local {table} = {{ -- {here} one {alg}"));
                for step in steps {
                    out.line(i, &format!("  {step} = {alg}_{step},"));
                }
                out.line(i, &format!("  one = {alg}_one,"));
                out.line(i, "}");
            }
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// `body` with each `--: paste` replaced by its fragment (see the top).
fn paste(
    body: Vec<Line>,
    fragments: &HashMap<String, Step>,
    source: &dyn Fn(usize) -> String,
) -> Result<Vec<Line>, String> {
    let mut out = Vec::with_capacity(body.len());
    for (at, line) in body {
        let Some(sig) = directive(&line).and_then(|d| d.strip_prefix("paste")) else {
            out.push((at, line));
            continue;
        };
        let indent: String = line.chars().take_while(|c| c.is_whitespace()).collect();
        let call = signature(sig)?;
        let fragment = fragments
            .get(&call.0)
            .ok_or_else(|| format!("no fragment `{}` defined before this paste", call.0))?;
        out.extend(spliced(
            "paste",
            (at, &indent),
            &call,
            fragment,
            false,
            source,
        )?);
    }
    Ok(out)
}

/// `step`'s body in a `do ... end` block at `indent`, for the call `(name,
/// args, outs)` at the line `at` (`what` names the caller in an error),
/// its first line naming the step's source. Each parameter is renamed to
/// its argument in the body, as a constant is (see `literals`: nothing is
/// bound at run time); with `by_name` the arguments must be the
/// parameters' own names. The results are the caller's locals of the
/// step's result names.
fn spliced(
    what: &str,
    (at, indent): (usize, &str),
    (name, args, outs): &(String, Vec<String>, Vec<String>),
    step: &Step,
    by_name: bool,
    source: &dyn Fn(usize) -> String,
) -> Result<Vec<Line>, String> {
    let args_fit = if by_name {
        *args == step.args
    } else {
        args.len() == step.args.len()
    };
    if !args_fit || *outs != step.outs {
        return Err(format!(
            "{what} {name}: called as ({}) -> {}, it takes ({}) -> {}",
            args.join(", "),
            outs.join(", "),
            step.args.join(", "),
            step.outs.join(", ")
        ));
    }
    let renamed: HashMap<String, String> = step
        .args
        .iter()
        .zip(args)
        .filter(|(param, arg)| param != arg)
        .map(|(param, arg)| (param.clone(), arg.clone()))
        .collect();
    let mut lines = vec![(step.at, format!("{indent}do -- {} {name}", source(step.at)))];
    lines.extend(
        step.body
            .iter()
            .map(|(origin, l)| (*origin, format!("{indent}{}", literals(l, &renamed)))),
    );
    lines.push((at, format!("{indent}end")));
    Ok(lines)
}

/// `local p1, p2 = s[2], s[3]` for the algorithm's parameters that `used`
/// admits, at the line `at`.
fn params(out: &mut Out, (at, indent): (usize, &str), a: &Algorithm, used: impl Fn(&str) -> bool) {
    let (names, slots): (Vec<&str>, Vec<String>) = a
        .params
        .iter()
        .enumerate()
        .filter(|(_, p)| used(p))
        .map(|(k, p)| (p.as_str(), format!("s[{}]", k + 2)))
        .unzip();
    if !names.is_empty() {
        out.line(
            at,
            &format!("{indent}local {} = {}", names.join(", "), slots.join(", ")),
        );
    }
}

/// The identifiers in `lines`.
fn words(lines: &[Line]) -> HashSet<&str> {
    lines
        .iter()
        .flat_map(|(_, l)| l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|w| !w.is_empty())
        .collect()
}

/// A step as a function over the state table `st` and the spec `s`: the
/// fields and parameters its body names, as locals, and the fields back.
fn function(out: &mut Out, alg: &str, name: &str, a: &Algorithm) {
    let step = &a.steps[name];
    let at = step.at;
    let named = words(&step.body);
    let mut args = vec!["st".to_owned(), "s".to_owned()];
    args.extend(step.args.iter().cloned());
    let header = format!(
        "local function {alg}_{name}({}) -- {} {name}",
        args.join(", "),
        (out.source)(at)
    );
    out.line(at, &header);
    params(out, (at, "  "), a, |p| named.contains(p));
    let state: Vec<&str> = a
        .state
        .iter()
        .map(String::as_str)
        .filter(|f| named.contains(f))
        .collect();
    let fields: Vec<String> = state.iter().map(|f| format!("st.{f}")).collect();
    if !state.is_empty() {
        out.line(
            at,
            &format!("  local {} = {}", state.join(", "), fields.join(", ")),
        );
    }
    if !step.outs.is_empty() {
        out.line(at, &format!("  local {}", step.outs.join(", ")));
    }
    for (origin, line) in &step.body {
        out.line(*origin, line);
    }
    if !state.is_empty() {
        out.line(
            at,
            &format!("  {} = {}", fields.join(", "), state.join(", ")),
        );
    }
    if !step.outs.is_empty() {
        out.line(at, &format!("  return {}", step.outs.join(", ")));
    }
    out.line(at, "end");
}

/// Reads `local A, B = 1, 2` at the start of a line, integers only, into
/// `constants` (name to its literal).
fn constant(line: &str, constants: &mut HashMap<String, String>) {
    let Some((names, values)) = line
        .strip_prefix("local ")
        .and_then(|l| l.split_once(" = "))
    else {
        return;
    };
    let names: Vec<&str> = names.split(", ").collect();
    let values: Vec<&str> = values.split(", ").collect();
    let word = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    let int = |v: &str| v.parse::<i64>().is_ok();
    if names.len() == values.len() && names.iter().all(|n| word(n)) && values.iter().all(|v| int(v))
    {
        for (name, value) in names.iter().zip(values) {
            constants.insert((*name).to_owned(), value.to_owned());
        }
    }
}

/// `line` with each identifier that names one of `constants` replaced by
/// its text (a literal, or a fragment's argument).
fn literals(line: &str, constants: &HashMap<String, String>) -> String {
    let mut out = String::with_capacity(line.len());
    let mut word = String::new();
    for c in line.chars().chain(std::iter::once('\n')) {
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
            continue;
        }
        out.push_str(constants.get(&word).map_or(&word, |v| v));
        word.clear();
        out.push(c);
    }
    out.pop();
    out
}

/// The template with `ALG_` named for the algorithm, `--: locals` its
/// parameters and state as locals, and each `--: inline` the step's body;
/// the `constants` of `lua/wire.lua` as literals (see the top).
fn instance(
    out: &mut Out,
    alg: &str,
    a: &Algorithm,
    template: &[Line],
    constants: &HashMap<String, String>,
) -> Result<(), String> {
    for (origin, line) in template {
        let indent: String = line.chars().take_while(|c| c.is_whitespace()).collect();
        match directive(line) {
            None => {
                let line = literals(line, constants)
                    .replace("ALG_", &format!("{alg}_"))
                    .replace("STORED", if a.stored { "true" } else { "false" });
                out.line(*origin, &line);
            }
            Some("locals") => {
                params(out, (*origin, &indent), a, |_| true);
                out.line(*origin, &format!("{indent}local {}", a.state.join(", ")));
            }
            Some(d) => {
                let sig = d
                    .strip_prefix("inline")
                    .ok_or_else(|| format!("`--: {d}` in a template"))?;
                let call = signature(sig)?;
                let step = a
                    .steps
                    .get(&call.0)
                    .ok_or_else(|| format!("{alg} has no step `{}`", call.0))?;
                let what = format!("template of {alg}:");
                let block = spliced(&what, (*origin, &indent), &call, step, true, out.source)?;
                for (origin, line) in block {
                    out.line(origin, &line);
                }
            }
        }
    }
    Ok(())
}

/// The `load(keys, i, v)` step of a state kept as a STRING (its directive
/// at line `at`): the tag byte `tag`, then `fields` as little-endian
/// doubles (a `+` after a name: positive); `v` the key's value when the
/// caller has it (false: absent), nil to read it.
fn load(at: usize, tag: &str, fields: &[String]) -> Result<Step, String> {
    if tag.len() != 1 || !fields.iter().any(|f| f == "written") {
        return Err(format!(
            "`--: stored`: tag `{tag}`, fields {fields:?} (one byte; `written` among them)"
        ));
    }
    let names: Vec<&str> = fields.iter().map(|f| f.trim_end_matches('+')).collect();
    let mut checks = vec![format!("tag == '{tag}'")];
    for (field, name) in fields.iter().zip(&names) {
        let low = if field.ends_with('+') {
            "0".to_owned()
        } else {
            format!("-{EXACT}")
        };
        checks.push(format!(
            "{name} % 1 == 0 and {name} > {low} and {name} < {EXACT}"
        ));
    }
    let body = format!(
        "  key, written, raw, dirty = keys[i], 0, false, false\n\
         \x20 if v == nil then\n\
         \x20   v = rpcall('GET', key)\n\
         \x20   absent = absent * ABSENT_DECAY -- (see common.lua)\n\
         \x20   if v == false then absent = absent + 1 end\n\
         \x20 end\n\
         \x20 if v and #v == {len} then -- (an error reply is a table: #v == 0)\n\
         \x20   local tag\n\
         \x20   tag, {list} = sunpack('<c1{doubles}', v)\n\
         \x20   -- (2^53 as a literal: an operand of the comparison, where an\n\
         \x20   -- upvalue must be loaded first)\n\
         \x20   raw = {checks}\n\
         \x20   if not raw then written = 0 end\n\
         \x20 end",
        len = 1 + 8 * fields.len(),
        list = names.join(", "),
        doubles = "d".repeat(fields.len()),
        checks = checks.join("\n      and "),
    );
    Ok(Step {
        at,
        args: vec!["keys".to_owned(), "i".to_owned(), "v".to_owned()],
        outs: Vec::new(),
        body: body.lines().map(|l| (at, l.to_owned())).collect(),
    })
}

/// 2^53: Lua's numbers are doubles, exact below it.
const EXACT: u64 = 1 << 53;
