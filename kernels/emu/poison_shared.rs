//! The cuda-emu build's rewrite of a kernel file (build.rs): `PT_EMU_POISON_SHARED(name);` after
//! every static `__shared__` declaration, so that `kernels/emu/cuda_emu.h` fills the variable
//! with poison once per block. Tested in `tests/emulator.rs`.

use std::path::Path;

/// `text` with `PT_EMU_POISON_SHARED(name);` right after every static `__shared__`
/// declaration's `;`, on its line. What this reads is one declaration to a line, `__shared__ T
/// name[N]...;` (CUDA allows no initialiser), outside comments; anything else that declares
/// static shared memory fails the build naming the line, so none goes unpoisoned. In a header
/// (`poison = false`) a static declaration is refused: it would be shared by every kernel file
/// that includes it, unpoisoned.
pub fn poison_static_shared(text: &str, path: &Path, poison: bool) -> String {
    let mut out = String::with_capacity(text.len() + 1024);
    let mut in_block_comment = false;
    for (i, line) in text.lines().enumerate() {
        let refuse = |why: &str| -> ! {
            panic!(
                "{}:{}: {why}; declare each static __shared__ variable on a line of its own as `__shared__ T \
                 name[N];` (dynamic shared memory through DYNAMIC_SHARED)",
                path.display(),
                i + 1
            )
        };
        let code = code_of(line, &mut in_block_comment);
        let found: Vec<usize> = code.match_indices("__shared__").map(|(at, _)| at).collect();
        let Some(&at) = found.first() else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        if code[..at].contains("extern") {
            // (The CUDA branch of DYNAMIC_SHARED in common.cuh; a kernel file uses the macro.)
            if poison {
                refuse("`extern __shared__` has no host equivalent");
            }
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if !poison {
            refuse("a header declares static shared memory");
        }
        if found.len() > 1 {
            refuse("two __shared__ declarations on one line");
        }
        if line.trim_end().ends_with('\\') {
            refuse("a __shared__ declaration inside a macro");
        }
        let decl = &code[at + "__shared__".len()..];
        let Some(end) = decl.find(';') else { refuse("a __shared__ declaration that does not end on its line") };
        let name = Some(&decl[..end])
            .filter(|d| !d.contains([',', '=']))
            .and_then(|d| d.split('[').next())
            .and_then(|d| d.split_whitespace().last())
            .filter(|n| n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        let Some(name) = name else { refuse("a __shared__ declaration with more than a type, a name and sizes") };
        // The code's columns are the line's: a comment after the `;` stays after the call.
        let semicolon = at + "__shared__".len() + end + 1;
        out.push_str(&line[..semicolon]);
        out.push_str(&format!(" PT_EMU_POISON_SHARED({name});"));
        out.push_str(&line[semicolon..]);
        out.push('\n');
    }
    out
}

/// `line` with its comments blanked out (`//` to the end, `/* … */`, also across lines through
/// `in_block`), each comment byte a space, so the code keeps the line's byte offsets.
fn code_of(line: &str, in_block: &mut bool) -> String {
    let bytes = line.as_bytes();
    let mut code = bytes.to_vec();
    let mut i = 0;
    while i < bytes.len() {
        let rest = &bytes[i..];
        if *in_block {
            *in_block = !rest.starts_with(b"*/");
            let n = if *in_block { 1 } else { 2 };
            code[i..i + n].fill(b' ');
            i += n;
        } else if rest.starts_with(b"//") {
            code[i..].fill(b' ');
            break;
        } else if rest.starts_with(b"/*") {
            *in_block = true;
            code[i..i + 2].fill(b' ');
            i += 2;
        } else {
            i += 1;
        }
    }
    // Whole code characters are kept and comment bytes become spaces: still UTF-8.
    String::from_utf8(code).unwrap_or_default()
}
