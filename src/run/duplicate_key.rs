//! Where a key or section of a TOML document written twice was first written: the parser names
//! only the second writing, and a user merging the two needs both.

/// The line (from 1) where the key or section header whose second writing starts at byte `at`
/// of `text` was first written, and that header (`[train]`) for a section, `None` for a key:
/// for a header, the same header anywhere before; for a key, the same key under the same
/// header. `None` where the second writing is not a line of its own at the top level (a key
/// inside an inline table or array that spans lines), or no first one is found.
pub(super) fn first_written(text: &str, at: usize) -> Option<(usize, Option<String>)> {
    let line_at = text.get(..at)?.matches('\n').count();
    let lines = top_level_lines(text);
    let again = lines.get(line_at)?.clone()?;
    let is_header = |l: &Option<String>| l.as_ref().is_some_and(|l| l.starts_with('['));
    if again.starts_with('[') {
        let first = lines[..line_at].iter().position(|l| l.as_deref() == Some(&again))?;
        return Some((first + 1, Some(again)));
    }
    // A key: under the nearest header above it (the top of the file without one).
    let key = again.split_once('=')?.0;
    let from = lines[..line_at].iter().rposition(is_header).map_or(0, |i| i + 1);
    let first = (from..line_at)
        .find(|&i| lines[i].as_deref().and_then(|l| l.split_once('=')).is_some_and(|(k, _)| k == key))?;
    Some((first + 1, None))
}

/// Each line of `text` (split as `str::lines` splits it) that starts at the top level, not inside
/// a multi-line string, array or inline table: its text outside comments, without the spaces
/// outside strings (`[ train ] # again` is `[train]`); `None` for the other lines.
fn top_level_lines(text: &str) -> Vec<Option<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum In {
        Code,
        Comment,
        /// A string, by its quote (`"` or `'`), and whether it is multi-line.
        Str(char, bool),
    }
    let (mut state, mut depth, mut lines) = (In::Code, 0usize, Vec::new());
    for line in text.split('\n') {
        let top = depth == 0 && !matches!(state, In::Str(_, true));
        let mut bare = String::new();
        if state == In::Comment {
            state = In::Code;
        }
        let chars: Vec<char> = line.trim_end_matches('\r').chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            let three = |q: char| chars.get(i..i + 3).is_some_and(|s| s.iter().all(|&x| x == q));
            match state {
                In::Comment => break,
                In::Code => match c {
                    '#' => state = In::Comment,
                    '"' | '\'' => {
                        let multi = three(c);
                        state = In::Str(c, multi);
                        if multi {
                            bare.extend([c, c]);
                            i += 2;
                        }
                        bare.push(c);
                    }
                    '[' | '{' => {
                        depth += 1;
                        bare.push(c);
                    }
                    ']' | '}' => {
                        depth = depth.saturating_sub(1);
                        bare.push(c);
                    }
                    // (A byte-order mark reads as a space.)
                    c if c.is_whitespace() || c == '\u{feff}' => {}
                    c => bare.push(c),
                },
                In::Str(q, multi) => {
                    bare.push(c);
                    if c == '\\' && q == '"' {
                        if let Some(&next) = chars.get(i + 1) {
                            bare.push(next);
                        }
                        i += 1;
                    } else if c == q && (!multi || three(q)) {
                        if multi {
                            bare.extend([q, q]);
                            i += 2;
                        }
                        state = In::Code;
                    }
                }
            }
            i += 1;
        }
        // (A one-line string that does not close ends with its line, as TOML has it.)
        if matches!(state, In::Str(_, false)) {
            state = In::Code;
        }
        lines.push(top.then_some(bare));
    }
    // (`str::lines` has no empty line after a final newline.)
    if text.ends_with('\n') {
        lines.pop();
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte where `needle`'s `n`-th writing (from 0) starts.
    fn nth(text: &str, needle: &str, n: usize) -> usize {
        text.match_indices(needle).nth(n).unwrap().0
    }

    #[test]
    fn the_first_writing_is_found_at_the_top_level_only() {
        // A section, spaces and a comment aside; a key under its own header only.
        let text = "[data]\nbatch_size = 3\n[train]\nlr = 1e-3\n\n[ data ] # again\nlr = 2\n";
        assert_eq!(first_written(text, nth(text, "data", 1)), Some((1, Some("[data]".into()))));
        assert_eq!(first_written(text, nth(text, "lr", 1)), None, "another section's lr");
        let text = "[train]\nlr = 1e-3\nepochs = 2\nlr = 2e-3\n";
        assert_eq!(first_written(text, nth(text, "lr", 1)), Some((2, None)));
        // A dotted header is named whole; CRLF line ends, a byte-order mark and multi-byte
        // text before change no line.
        let text = "\u{feff}[train.optimizer]\r\nkind = \"adamw\"\r\n# é, 漢字\r\n[train.optimizer]\r\n";
        assert_eq!(first_written(text, nth(text, "train", 1)), Some((1, Some("[train.optimizer]".into()))));
        // A `#` inside a quoted key is the key's, not a comment.
        let text = "[\"a#b\"]\nx = 1\n[\"a#c\"]\n[\"a#b\"]\n";
        assert_eq!(first_written(text, nth(text, "\"a#b\"", 1)), Some((1, Some("[\"a#b\"]".into()))));
        // Lines inside a multi-line string, array or inline table are not top-level lines.
        let text = "[m]\nc = {\n  f = 1,\n  f = 2,\n}\nf = 3\n";
        assert_eq!(first_written(text, nth(text, "f = 2", 0)), None);
        let text = "[m]\ns = \"\"\"\nf = 1\n[m]\n\"\"\"\nf = 2\nf = 3\n";
        assert_eq!(first_written(text, nth(text, "f = 3", 0)), Some((6, None)), "not the string's f");
        let text = "[m]\na = [\n[1],\n]\n[m]\n";
        assert_eq!(first_written(text, nth(text, "[m]", 1)), Some((1, Some("[m]".into()))));
        assert_eq!(top_level_lines(text), [Some("[m]".into()), Some("a=[".into()), None, None, Some("[m]".into())]);
    }
}
