//! A small RFC 4180 CSV record reader: quoted fields may hold commas, doubled quotes and
//! newlines (the Rotten Tomatoes plot summaries span lines), so records are not lines. Blank
//! lines between records are skipped. Errors carry the line where the bad record starts.

use std::path::Path;

use super::files::dataset_error;
use crate::error::Result;

/// One record and the 1-based line it starts on.
#[derive(Debug, PartialEq)]
pub(crate) struct CsvRecord {
    pub line: usize,
    pub fields: Vec<String>,
}

/// Iterator over the records of a CSV text.
pub(crate) struct CsvRecords<'a> {
    path: &'a Path,
    text: &'a str,
    pos: usize,
    line: usize,
}

impl<'a> CsvRecords<'a> {
    /// Records of `text`; `path` only names the file in errors.
    pub fn new(path: &'a Path, text: &'a str) -> Self {
        Self { path, text, pos: 0, line: 1 }
    }

    /// Consumes a line end (`\n` or `\r\n`) at the current position, if there is one.
    fn eat_newline(&mut self) -> bool {
        let rest = &self.text.as_bytes()[self.pos..];
        let n = match rest {
            [b'\n', ..] => 1,
            [b'\r', b'\n', ..] => 2,
            _ => return false,
        };
        self.pos += n;
        self.line += 1;
        true
    }

    fn record(&mut self) -> Result<CsvRecord> {
        let start_line = self.line;
        let text = self.text;
        let bytes = text.as_bytes();
        let mut fields = Vec::new();
        loop {
            let mut field = String::new();
            if bytes.get(self.pos) == Some(&b'"') {
                self.pos += 1;
                loop {
                    let Some(k) = text[self.pos..].find('"') else {
                        return Err(dataset_error(
                            self.path,
                            Some(start_line),
                            "unterminated quoted field: expected a closing '\"' before the end of the file",
                        ));
                    };
                    let seg = &text[self.pos..self.pos + k];
                    self.line += seg.matches('\n').count();
                    field.push_str(seg);
                    self.pos += k + 1;
                    // `""` inside quotes is one literal quote.
                    if bytes.get(self.pos) == Some(&b'"') {
                        field.push('"');
                        self.pos += 1;
                    } else {
                        break;
                    }
                }
                fields.push(field);
                if self.pos == bytes.len() || self.eat_newline() {
                    return Ok(CsvRecord { line: start_line, fields });
                }
                if bytes[self.pos] == b',' {
                    self.pos += 1;
                    continue;
                }
                return Err(dataset_error(
                    self.path,
                    Some(self.line),
                    format!(
                        "field {} has text after its closing quote; expected ',' or the end of the line",
                        fields.len()
                    ),
                ));
            }
            let rest = &text[self.pos..];
            let k = rest.find([',', '\n']).unwrap_or(rest.len());
            let seg = &rest[..k];
            // A `\r` right before the `\n` belongs to the line end (CRLF), not the field.
            let seg = if rest.as_bytes().get(k) == Some(&b'\n') { seg.strip_suffix('\r').unwrap_or(seg) } else { seg };
            field.push_str(seg);
            fields.push(field);
            self.pos += k;
            if self.pos == bytes.len() || self.eat_newline() {
                return Ok(CsvRecord { line: start_line, fields });
            }
            self.pos += 1; // the ','
        }
    }
}

impl Iterator for CsvRecords<'_> {
    type Item = Result<CsvRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        while self.eat_newline() {}
        if self.pos >= self.text.len() {
            return None;
        }
        let r = self.record();
        if r.is_err() {
            // Stop after the first error: the position inside a broken record means nothing.
            self.pos = self.text.len();
        }
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Vec<(usize, Vec<String>)> {
        CsvRecords::new(Path::new("t.csv"), text).map(|r| r.map(|r| (r.line, r.fields)).unwrap()).collect()
    }

    #[test]
    fn quotes_commas_newlines_and_blank_lines() {
        let got = parse("a,b\r\n\"x, \"\"y\"\"\nz\",2\n\n,\nlast");
        let want = vec![
            (1, vec!["a".to_string(), "b".into()]),
            (2, vec!["x, \"y\"\nz".to_string(), "2".into()]),
            (5, vec![String::new(), String::new()]),
            (6, vec!["last".to_string()]),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn unterminated_quote_names_the_starting_line() {
        let err = CsvRecords::new(Path::new("t.csv"), "a\n\"open\nmore").find_map(|r| r.err()).unwrap();
        assert!(matches!(err, crate::Error::Dataset { line: Some(2), .. }), "{err}");
        assert!(err.to_string().contains("unterminated"), "{err}");
    }

    #[test]
    fn text_after_closing_quote_is_an_error() {
        let err = CsvRecords::new(Path::new("t.csv"), "\"a\"b,c\n").find_map(|r| r.err()).unwrap();
        assert!(err.to_string().contains("t.csv: line 1: field 1 has text after its closing quote"), "{err}");
    }
}
