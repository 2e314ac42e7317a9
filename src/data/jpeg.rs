//! JPEG decoding, bit for bit as libjpeg-turbo decodes a file by default: the decoder behind
//! Pillow's `Image.open` (and so torchvision's `ImageFolder` and Hugging Face's image
//! processors), so a model sees here the pixels it sees there. JPEG decoders differ from one
//! another by a level or more in some pixels: the inverse DCT, the chroma upsampling and the
//! colour conversion each round their own way. `tests/fixtures/make_jpeg_fixtures.py` writes
//! the fixtures this is checked against.
//!
//! - Huffman-coded baseline, extended and progressive files (ITU T.81 §F, §G), with restart
//!   intervals; gray (1 component) or colour (3: YCbCr, or RGB where an Adobe marker or the
//!   component ids say so, as libjpeg guesses).
//! - libjpeg's accurate integer inverse DCT (`jidctint.c`, "islow", the default), its output
//!   clamped through the same wrapping range-limit table.
//! - "Fancy" chroma upsampling (`jdsample.c`): a triangle filter for 2:1 horizontally,
//!   vertically or both, replication for other integer ratios and for chroma 2 samples wide
//!   or less; edges replicated as libjpeg's context rows replicate them.
//! - YCbCr → RGB through libjpeg's 16-bit fixed-point tables (`jdcolor.c`).
//!
//! Refused by name: arithmetic coding, lossless and hierarchical files, 12-bit samples,
//! 4-component (CMYK/YCCK) files, fractional sampling ratios, and a progressive file whose scans
//! leave any of a block's first 9 AC coefficients short of their last bit, which libjpeg
//! decodes with block smoothing (`decompress_smooth_data`), not written here (encoders refine
//! every coefficient to its last bit). Where libjpeg warns and goes on, a file is refused: a
//! damaged one (a bad Huffman code, image data or a file that ends early, a missing restart
//! marker: Pillow refuses a truncated file too), and scans out of T.81's progression (a
//! coefficient refined before it is first coded, or by other than one bit). EXIF orientation is
//! not applied, as Pillow's `open` does not apply it. A damaged file's samples far outside
//! 0..=255 wrap as libjpeg's C code wraps them; its SIMD code (Pillow's on x86 and Arm)
//! saturates instead, so for such a file Pillow's pixels depend on the CPU.

/// A decoded image: `channels` planes of `height × width` samples, channel-first.
pub(super) struct Jpeg {
    pub width: usize,
    pub height: usize,
    pub channels: usize,
    pub pixels: Vec<u8>,
}

/// Zigzag index → natural (row-major) position in a block, with 16 more entries that send a
/// corrupt run past the 63rd coefficient to the last one (libjpeg's `jpeg_natural_order`).
const NATURAL_ORDER: [usize; 80] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6, 7, 14, 21,
    28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54,
    47, 55, 62, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63,
];

type Fail = String;

/// More scans than any encoder writes (a progressive file has about ten). With T.81's
/// progression enforced, a component takes at most 14 scans of each coefficient; this bounds
/// further the work a crafted file can ask for.
const MOST_SCANS: usize = 1000;

/// Largest width or height libjpeg decodes (`JPEG_MAX_DIMENSION`).
const MOST_SIDE: usize = 65500;

/// Most blocks in one MCU (`D_MAX_BLOCKS_IN_MCU`).
const MOST_MCU_BLOCKS: usize = 10;

/// The image in `bytes` (which start with the SOI marker `FF D8`), or what is wrong with it
/// (said as the rest of "the file …").
pub(super) fn decode_jpeg(bytes: &[u8], max_pixels: u64) -> Result<Jpeg, Fail> {
    let mut decoder = Decoder::default();
    let mut at = 2;
    loop {
        // A file without its end-of-image marker: Pillow refuses it as truncated.
        let (marker, body_at) =
            next_marker(bytes, at).ok_or("ends before its end-of-image marker; the file is truncated")?;
        match marker {
            0xD9 => break,
            0xD0..=0xD7 => at = body_at, // a stray restart marker: nothing to read
            0x01 => at = body_at,
            _ => {
                let len = segment_length(bytes, body_at, marker)?;
                let body = &bytes[body_at + 2..body_at + len];
                at = body_at + len;
                match marker {
                    0xC0..=0xC2 => decoder.frame(body, marker == 0xC2, max_pixels)?,
                    0xC3 | 0xC5..=0xC7 | 0xCB | 0xCD..=0xCF => {
                        return Err("uses lossless or hierarchical JPEG coding, which is not supported; save it as \
                                    a baseline or progressive JPEG, or as a PNG"
                            .into());
                    }
                    0xC9 | 0xCA => {
                        return Err("uses arithmetic coding, which is not supported; save it with Huffman coding \
                                    (a baseline or progressive JPEG), or as a PNG"
                            .into());
                    }
                    0xC4 => decoder.huffman_tables(body)?,
                    0xDB => decoder.quantization_tables(body)?,
                    0xDD => {
                        let interval = body.get(..2).ok_or("has a restart-interval segment of fewer than 2 bytes")?;
                        decoder.restart_interval = u16::from_be_bytes([interval[0], interval[1]]) as usize;
                    }
                    0xDA => at = decoder.scan(body, bytes, at)?,
                    // The colour space is settled at the first scan, as libjpeg settles it
                    // (`examine_app0` and `examine_app14` read bodies of 14 and 12 bytes or more).
                    0xE0 if decoder.scans == 0 && body.len() >= 14 => decoder.jfif |= body.starts_with(b"JFIF\0"),
                    0xEE if decoder.scans == 0 && body.starts_with(b"Adobe") && body.len() >= 12 => {
                        decoder.adobe_transform = Some(body[11])
                    }
                    _ => {} // APPn, COM, DNL (libjpeg skips it) and the like: nothing the pixels depend on
                }
            }
        }
    }
    decoder.finish()
}

/// The first marker at or after `at` (skipping fill bytes `FF` and, as libjpeg does with a
/// warning, any other bytes before it): its code and where its segment starts; none at the end.
fn next_marker(bytes: &[u8], mut at: usize) -> Option<(u8, usize)> {
    loop {
        match (bytes.get(at)?, bytes.get(at + 1)) {
            (0xFF, Some(0xFF)) => at += 1,
            (0xFF, Some(&code)) if code != 0 => return Some((code, at + 2)),
            _ => at += 1,
        }
    }
}

/// A marker segment's length (which counts its own two bytes), checked against the file.
fn segment_length(bytes: &[u8], at: usize, marker: u8) -> Result<usize, Fail> {
    let len = bytes.get(at..at + 2).map(|b| u16::from_be_bytes([b[0], b[1]]) as usize);
    match len {
        Some(len) if len >= 2 && at + len <= bytes.len() => Ok(len),
        Some(len) if len < 2 => {
            Err(format!("has a marker segment (FF {marker:02X}) of length {len}; expected 2 or more"))
        }
        _ => Err(format!("has a marker segment (FF {marker:02X}) that runs past the end of the file; it is truncated")),
    }
}

/// A Huffman table: canonical codes by length (T.81 §F.2.2.3) with a 9-bit lookup in front.
struct Huffman {
    /// For each 9-bit prefix, the length and value of the code it starts with (length 0: longer).
    fast: Vec<(u8, u8)>,
    /// The largest code of each length, -1 where none; and what to add to a code to index `values`.
    max_code: [i32; 17],
    offset: [i32; 17],
    values: Vec<u8>,
}

impl Huffman {
    fn new(counts: &[u8], values: &[u8]) -> Result<Self, Fail> {
        let (mut max_code, mut offset, mut fast) = ([-1; 17], [0; 17], vec![(0, 0); 512]);
        let (mut code, mut k) = (0i32, 0usize);
        for len in 1..=16 {
            offset[len] = k as i32 - code;
            for _ in 0..counts[len - 1] {
                // libjpeg's check (`jpeg_make_d_derived_tbl`): no code of all ones.
                if code >= (1 << len) - 1 {
                    return Err("has a Huffman table with more codes than its code lengths allow".into());
                }
                if len <= 9 {
                    let first = (code as usize) << (9 - len);
                    fast[first..first + (1 << (9 - len))].fill((len as u8, values[k]));
                }
                code += 1;
                k += 1;
            }
            if counts[len - 1] > 0 {
                max_code[len] = code - 1;
            }
            code <<= 1;
        }
        Ok(Self { fast, max_code, offset, values: values.to_vec() })
    }
}

/// The entropy-coded data of a scan as a stream of bits: `FF 00` is a data byte `FF`; at a
/// marker or the end, zeros (as libjpeg supplies them), counted so a scan that reads into them
/// is known to be cut short.
struct Bits<'a> {
    data: &'a [u8],
    at: usize,
    acc: u64,
    count: u32,
    zeros: u64,
}

impl<'a> Bits<'a> {
    fn new(data: &'a [u8], at: usize) -> Self {
        Self { data, at, acc: 0, count: 0, zeros: 0 }
    }

    fn refill(&mut self) {
        while self.count <= 56 {
            let byte = match (self.data.get(self.at), self.data.get(self.at + 1)) {
                (Some(0xFF), Some(0x00)) => {
                    self.at += 2;
                    0xFF
                }
                (Some(0xFF), _) | (None, _) => {
                    self.zeros += 8;
                    0
                }
                (Some(&b), _) => {
                    self.at += 1;
                    b
                }
            };
            self.acc |= u64::from(byte) << (56 - self.count);
            self.count += 8;
        }
    }

    fn peek(&mut self, n: u32) -> u32 {
        if self.count < n {
            self.refill();
        }
        (self.acc >> (64 - n)) as u32
    }

    fn skip(&mut self, n: u32) {
        self.acc <<= n;
        self.count -= n;
    }

    fn bits(&mut self, n: u32) -> u32 {
        if n == 0 {
            return 0;
        }
        let v = self.peek(n);
        self.skip(n);
        v
    }

    fn bit(&mut self) -> bool {
        self.bits(1) == 1
    }

    /// `n` bits read as a signed value in category `n` (T.81 §F.2.2.1, `HUFF_EXTEND`).
    fn signed(&mut self, n: u32) -> i32 {
        let v = self.bits(n) as i32;
        if n > 0 && v < 1 << (n - 1) { v - (1 << n) + 1 } else { v }
    }

    fn decode(&mut self, table: &Huffman) -> Result<u8, Fail> {
        let p = self.peek(16);
        let (len, value) = table.fast[(p >> 7) as usize];
        if len > 0 {
            self.skip(u32::from(len));
            return Ok(value);
        }
        for len in 10..=16 {
            let code = (p >> (16 - len)) as i32;
            if code <= table.max_code[len] {
                self.skip(len as u32);
                return table
                    .values
                    .get((code + table.offset[len]) as usize)
                    .copied()
                    .ok_or_else(|| "has a bad Huffman code in its image data; it is damaged".into());
            }
        }
        Err("has a bad Huffman code in its image data; it is damaged".into())
    }

    /// Whether the scan read past its data into the zeros supplied after it.
    fn overran(&self) -> bool {
        self.zeros > u64::from(self.count)
    }
}

/// One image component: its sampling factors, quantization table, and its coefficients,
/// `blocks_wide × blocks_high` blocks of 64 in natural order (covering whole MCUs).
struct Component {
    id: u8,
    h: usize,
    v: usize,
    table: usize,
    /// Latched at the first scan that holds the component, as libjpeg latches it.
    quant: Option<[u16; 64]>,
    /// Samples across and down the image (before upsampling).
    width: usize,
    height: usize,
    blocks_wide: usize,
    blocks_high: usize,
    /// Allocated at the component's first scan, once the file is known to hold that many blocks.
    coefs: Vec<i16>,
    /// For each coefficient (zigzag index) of a progressive file, the lowest bit coded so far
    /// (-1: none yet): libjpeg's `coef_bits`, which checks the progression and decides smoothing.
    coef_bits: [i8; 64],
    dc_pred: i32,
}

#[derive(Default)]
struct Decoder {
    width: usize,
    height: usize,
    progressive: bool,
    components: Vec<Component>,
    max_h: usize,
    max_v: usize,
    quant: [Option<[u16; 64]>; 4],
    dc_tables: [Option<Huffman>; 4],
    ac_tables: [Option<Huffman>; 4],
    restart_interval: usize,
    eob_run: u32,
    scans: usize,
    jfif: bool,
    adobe_transform: Option<u8>,
}

/// A scan's header: its components and, for progressive files, the spectral band
/// `start..=end` (zigzag indices) and the bits: `ah`, the bit coded before (0 in a first scan),
/// and `al`, the bit this scan codes down to (T.81's names).
struct Scan {
    components: Vec<ScanComponent>,
    start: usize,
    end: usize,
    ah: u32,
    al: u32,
}

/// A component in a scan: its index in the frame and its Huffman tables' ids.
struct ScanComponent {
    index: usize,
    dc: usize,
    ac: usize,
}

impl Decoder {
    fn frame(&mut self, body: &[u8], progressive: bool, max_pixels: u64) -> Result<(), Fail> {
        if !self.components.is_empty() {
            return Err("has two frame headers; expected one".into());
        }
        if body.len() < 6 {
            return Err("has a frame header of fewer than 6 bytes".into());
        }
        if body[0] != 8 {
            return Err(format!("has {}-bit samples; only 8-bit JPEGs are supported", body[0]));
        }
        let height = u16::from_be_bytes([body[1], body[2]]) as usize;
        let width = u16::from_be_bytes([body[3], body[4]]) as usize;
        let n = body[5] as usize;
        if width == 0 || height == 0 || width > MOST_SIDE || height > MOST_SIDE {
            return Err(format!(
                "is {width}×{height} by its frame header; expected sides of 1 to {MOST_SIDE} (a height set later \
                 by a DNL marker is not supported, as libjpeg does not support it)"
            ));
        }
        if width as u64 * height as u64 > max_pixels {
            let side = (max_pixels as f64).sqrt() as u64;
            return Err(format!("is a {width}×{height} JPEG; expected at most {max_pixels} pixels ({side} × {side})"));
        }
        match n {
            1 | 3 => {}
            4 => return Err("is a CMYK JPEG (4 components); save it as RGB or gray".into()),
            _ => return Err(format!("has {n} components; expected 1 (gray) or 3 (colour)")),
        }
        if body.len() < 6 + 3 * n {
            return Err(format!(
                "has a frame header of {} bytes; expected {} for {n} components",
                body.len(),
                6 + 3 * n
            ));
        }
        let fields: Vec<&[u8]> = body[6..6 + 3 * n].chunks_exact(3).collect();
        for c in &fields {
            let (h, v, table) = (c[1] >> 4, c[1] & 15, c[2]);
            if !(1..=4).contains(&h) || !(1..=4).contains(&v) || table > 3 {
                return Err(format!(
                    "has component {} sampled {h}×{v} with quantization table {table}; expected factors 1 to 4 and \
                     a table 0 to 3",
                    c[0]
                ));
            }
        }
        let (max_h, max_v) =
            fields.iter().fold((1, 1), |(h, v), c| (h.max(c[1] as usize >> 4), v.max(c[1] as usize & 15)));
        for c in fields {
            let (h, v, table) = (c[1] as usize >> 4, c[1] as usize & 15, c[2] as usize);
            if max_h % h != 0 || max_v % v != 0 {
                return Err(format!(
                    "samples component {} {h}×{v} against {max_h}×{max_v}: a fractional ratio, which libjpeg does \
                     not decode either",
                    c[0]
                ));
            }
            // Whole MCUs of blocks, so an interleaved scan never writes outside.
            let (mcus_wide, mcus_high) = (width.div_ceil(8 * max_h), height.div_ceil(8 * max_v));
            let (blocks_wide, blocks_high) = (mcus_wide * h, mcus_high * v);
            self.components.push(Component {
                id: c[0],
                h,
                v,
                table,
                quant: None,
                width: (width * h).div_ceil(max_h),
                height: (height * v).div_ceil(max_v),
                blocks_wide,
                blocks_high,
                coefs: Vec::new(),
                coef_bits: [-1; 64],
                dc_pred: 0,
            });
        }
        (self.width, self.height, self.progressive, self.max_h, self.max_v) =
            (width, height, progressive, max_h, max_v);
        Ok(())
    }

    fn huffman_tables(&mut self, mut body: &[u8]) -> Result<(), Fail> {
        while !body.is_empty() {
            let short = || Fail::from("has a Huffman table segment that ends inside a table");
            let (class, id) = (body[0] >> 4, body[0] as usize & 15);
            let counts = body.get(1..17).ok_or_else(short)?;
            let n: usize = counts.iter().map(|&c| c as usize).sum();
            let values = body.get(17..17 + n).ok_or_else(short)?;
            if class > 1 || id > 3 || n > 256 {
                return Err(format!(
                    "has a Huffman table of class {class}, id {id}, {n} codes; expected class 0 or 1, \
                                    id 0 to 3, at most 256 codes"
                ));
            }
            let table = Some(Huffman::new(counts, values)?);
            match class {
                0 => self.dc_tables[id] = table,
                _ => self.ac_tables[id] = table,
            }
            body = &body[17 + n..];
        }
        Ok(())
    }

    fn quantization_tables(&mut self, mut body: &[u8]) -> Result<(), Fail> {
        while !body.is_empty() {
            // Any precision but 0 means 16-bit values, as libjpeg reads it.
            let (wide, id) = (body[0] >> 4 != 0, body[0] as usize & 15);
            let size = if wide { 128 } else { 64 };
            let values = body.get(1..1 + size).ok_or("has a quantization table segment that ends inside a table")?;
            if id > 3 {
                return Err(format!("has a quantization table of id {id}; expected 0 to 3"));
            }
            let mut table = [0u16; 64];
            for (k, &natural) in NATURAL_ORDER[..64].iter().enumerate() {
                table[natural] =
                    if wide { u16::from_be_bytes([values[2 * k], values[2 * k + 1]]) } else { u16::from(values[k]) };
            }
            self.quant[id] = Some(table);
            body = &body[1 + size..];
        }
        Ok(())
    }

    /// Reads the scan whose header is `body` and whose data starts at `at`; returns where its
    /// data ends.
    fn scan(&mut self, body: &[u8], bytes: &[u8], at: usize) -> Result<usize, Fail> {
        if self.components.is_empty() {
            return Err("has a scan before its frame header".into());
        }
        let n = body.first().copied().unwrap_or(0) as usize;
        if n == 0 || n > 4 || body.len() < 1 + 2 * n + 3 {
            return Err(format!("has a scan header of {} bytes for {n} components", body.len()));
        }
        let mut components = Vec::with_capacity(n);
        for field in body[1..1 + 2 * n].chunks_exact(2) {
            let index = self.components.iter().position(|c| c.id == field[0]).ok_or_else(|| {
                format!("has a scan of component {}, which its frame header does not declare", field[0])
            })?;
            components.push(ScanComponent { index, dc: field[1] as usize >> 4, ac: field[1] as usize & 15 });
        }
        let tail = &body[1 + 2 * n..];
        let mut scan = Scan {
            components,
            start: tail[0] as usize,
            end: tail[1] as usize,
            ah: u32::from(tail[2] >> 4),
            al: u32::from(tail[2] & 15),
        };
        if !self.progressive {
            // A sequential scan codes every coefficient whatever these bytes say (libjpeg warns
            // and reads them so: "some baseline files out there with all zeroes").
            (scan.start, scan.end, scan.ah, scan.al) = (0, 63, 0, 0);
        } else {
            let dc = scan.start == 0;
            if (dc && scan.end != 0) || (!dc && (scan.end < scan.start || scan.end > 63 || n != 1)) || scan.al > 13 {
                return Err(format!(
                    "has a scan of coefficients {}..={} (bits {}, {}) that T.81 does not allow",
                    scan.start, scan.end, scan.ah, scan.al
                ));
            }
            self.advance_progression(&scan)?;
        }
        let per_mcu: usize = match scan.components.as_slice() {
            [_] => 1,
            many => many.iter().map(|s| self.components[s.index].h * self.components[s.index].v).sum(),
        };
        if per_mcu > MOST_MCU_BLOCKS {
            return Err(format!("has {per_mcu} blocks in an MCU; expected at most {MOST_MCU_BLOCKS}, as libjpeg"));
        }
        // Each block of a DC scan (every scan of a sequential file) takes at least one bit: a
        // header promising more blocks than the rest of the file holds is refused before its
        // coefficients are allocated.
        let (mcus_wide, mcus_high) = self.scan_mcus(&scan);
        let blocks = mcus_wide * mcus_high * per_mcu;
        if scan.start == 0 && blocks > 8 * (bytes.len() - at) {
            return Err(format!(
                "promises {blocks} blocks in a scan (of a {}×{} image), more than its last {} bytes can hold; \
                 the file is truncated or its header is damaged",
                self.width,
                self.height,
                bytes.len() - at
            ));
        }
        self.scans += 1;
        if self.scans > MOST_SCANS {
            return Err(format!("has more than {MOST_SCANS} scans; encoders write about ten at most"));
        }
        for s in &scan.components {
            let needs_dc = scan.start == 0 && scan.ah == 0;
            let needs_ac = scan.end > 0;
            if (needs_dc && self.dc_tables.get(s.dc).is_none_or(Option::is_none))
                || (needs_ac && self.ac_tables.get(s.ac).is_none_or(Option::is_none))
            {
                return Err("has a scan that uses a Huffman table it does not define".into());
            }
            let c = &mut self.components[s.index];
            if c.coefs.is_empty() {
                c.coefs = vec![0; c.blocks_wide * c.blocks_high * 64];
                c.quant = Some(self.quant[c.table].ok_or("uses a quantization table it does not define")?);
            }
            c.dc_pred = 0;
        }
        self.eob_run = 0;
        self.read_scan(&scan, Bits::new(bytes, at))
    }

    /// Checks a progressive scan against T.81's progression (G.1.1.1.1) and records it: a
    /// component's first scan codes its DC; a first scan of a coefficient finds it uncoded; a
    /// refinement finds it coded down to bit `ah` and codes one bit more. libjpeg warns and
    /// goes on where this refuses.
    fn advance_progression(&mut self, scan: &Scan) -> Result<(), Fail> {
        for s in &scan.components {
            let c = &mut self.components[s.index];
            let expected = if scan.ah == 0 { -1 } else { scan.ah as i8 };
            let in_order = (scan.start == 0 || c.coef_bits[0] >= 0)
                && (scan.ah == 0 || scan.al + 1 == scan.ah)
                && c.coef_bits[scan.start..=scan.end].iter().all(|&b| b == expected);
            if !in_order {
                return Err(format!(
                    "has a scan out of T.81's progression: coefficients {}..={} of component {} coded to bit {} \
                     (after bit {}), but they were coded to bits {:?} (-1: not yet) and its DC to bit {}; \
                     libjpeg decodes such a file with a warning, this decoder refuses it",
                    scan.start,
                    scan.end,
                    c.id,
                    scan.al,
                    scan.ah,
                    &c.coef_bits[scan.start..=scan.end],
                    c.coef_bits[0]
                ));
            }
            c.coef_bits[scan.start..=scan.end].fill(scan.al as i8);
        }
        Ok(())
    }

    /// The MCUs of a scan across and down: one block each for a scan of one component (the
    /// component's own blocks, in raster order), else `h × v` blocks of each component.
    fn scan_mcus(&self, scan: &Scan) -> (usize, usize) {
        match scan.components.as_slice() {
            [one] => {
                let c = &self.components[one.index];
                (c.width.div_ceil(8), c.height.div_ceil(8))
            }
            _ => (self.width.div_ceil(8 * self.max_h), self.height.div_ceil(8 * self.max_v)),
        }
    }

    fn read_scan(&mut self, scan: &Scan, mut bits: Bits) -> Result<usize, Fail> {
        let single = scan.components.len() == 1;
        let (mcus_wide, mcus_high) = self.scan_mcus(scan);
        let truncated = "has image data that ends before its last block; the file is truncated or damaged";
        for mcu in 0..mcus_wide * mcus_high {
            if self.restart_interval > 0 && mcu > 0 && mcu % self.restart_interval == 0 {
                bits = self.restart(bits)?;
            }
            // A scan cut short stops at the next row, not after decoding zeros to its end.
            if mcu % mcus_wide == 0 && bits.overran() {
                return Err(truncated.into());
            }
            let (mx, my) = (mcu % mcus_wide, mcu / mcus_wide);
            for s in &scan.components {
                let c = &mut self.components[s.index];
                let (h, v) = if single { (1, 1) } else { (c.h, c.v) };
                let dc = self.dc_tables.get(s.dc).and_then(Option::as_ref);
                let ac = self.ac_tables.get(s.ac).and_then(Option::as_ref);
                for (bx, by) in (0..v).flat_map(|y| (0..h).map(move |x| (x, y))) {
                    let at = ((my * v + by) * c.blocks_wide + mx * h + bx) * 64;
                    let block: &mut [i16; 64] = (&mut c.coefs[at..at + 64]).try_into().expect("64 coefficients");
                    match (self.progressive, scan.start, scan.ah) {
                        (false, _, _) => read_block(&mut bits, dc, ac, block, &mut c.dc_pred)?,
                        (true, 0, 0) => read_dc_first(&mut bits, dc, block, &mut c.dc_pred, scan.al)?,
                        (true, 0, _) => read_dc_refine(&mut bits, block, scan.al),
                        (true, _, 0) => read_ac_first(&mut bits, ac, block, scan, &mut self.eob_run)?,
                        (true, _, _) => read_ac_refine(&mut bits, ac, block, scan, &mut self.eob_run)?,
                    }
                }
            }
        }
        if bits.overran() {
            return Err(truncated.into());
        }
        Ok(bits.at)
    }

    /// At a restart marker: drop the bits left of the byte, step over `RSTn`, and start the DC
    /// predictions and the end-of-band run afresh.
    fn restart<'a>(&mut self, bits: Bits<'a>) -> Result<Bits<'a>, Fail> {
        if bits.overran() {
            return Err("has image data that ends before a restart marker; the file is damaged".into());
        }
        let mut at = bits.at;
        while bits.data.get(at) == Some(&0xFF) && bits.data.get(at + 1) == Some(&0xFF) {
            at += 1;
        }
        match (bits.data.get(at), bits.data.get(at + 1)) {
            (Some(0xFF), Some(0xD0..=0xD7)) => {}
            _ => return Err("lacks a restart marker where its restart interval says one is; it is damaged".into()),
        }
        for c in &mut self.components {
            c.dc_pred = 0;
        }
        self.eob_run = 0;
        Ok(Bits::new(bits.data, at + 2))
    }

    /// Whether libjpeg would smooth this file's blocks (`smoothing_ok` in `jdcoefct.c`): a
    /// progressive file whose every component has its DC coded, whose quantizers for the DC and
    /// first 9 AC coefficients are nonzero, and one of whose components has any of those 9 AC
    /// coefficients not coded to its last bit.
    fn libjpeg_would_smooth(&self) -> bool {
        let first = &NATURAL_ORDER[..10];
        self.progressive
            && self
                .components
                .iter()
                .all(|c| c.coef_bits[0] >= 0 && c.quant.is_some_and(|q| first.iter().all(|&i| q[i] != 0)))
            && self.components.iter().any(|c| c.coef_bits[1..10].iter().any(|&b| b != 0))
    }

    /// The pixels: every block through the inverse DCT, chroma upsampled, colour converted.
    fn finish(self) -> Result<Jpeg, Fail> {
        if self.scans == 0 {
            return Err("has no image data (no scan before its end); the file is truncated or damaged".into());
        }
        if let Some(c) = self.components.iter().find(|c| c.coefs.is_empty()) {
            return Err(format!("has no scan of component {}; the file is truncated or damaged", c.id));
        }
        if self.libjpeg_would_smooth() {
            return Err("is a progressive JPEG whose scans leave low-frequency coefficients short of their last \
                        bit, which libjpeg decodes with block smoothing, not done here; save it again (encoders \
                        refine every coefficient)"
                .into());
        }
        // libjpeg's guess (`jdapimin.c`): JFIF means YCbCr; an Adobe marker says which;
        // otherwise the ids `R`, `G`, `B` mean RGB.
        let ids: Vec<u8> = self.components.iter().map(|c| c.id).collect();
        let rgb = !self.jfif && (self.adobe_transform == Some(0) || (self.adobe_transform.is_none() && ids == b"RGB"));
        let (width, height, max_h, max_v) = (self.width, self.height, self.max_h, self.max_v);
        // Each component's coefficients are dropped once its samples are made.
        let planes: Vec<Vec<u8>> = self
            .components
            .into_iter()
            .map(|c| {
                let quant = c.quant.expect("latched at the component's first scan");
                let stride = c.blocks_wide * 8;
                let mut plane = vec![0u8; stride * c.blocks_high * 8];
                for (b, block) in c.coefs.chunks_exact(64).enumerate() {
                    let (bx, by) = (b % c.blocks_wide, b / c.blocks_wide);
                    idct_islow(block, &quant, &mut plane[by * 8 * stride + bx * 8..], stride);
                }
                upsample(&plane, stride, &c, max_h / c.h, max_v / c.v, width, height)
            })
            .collect();
        let n = width * height;
        let mut pixels = Vec::with_capacity(planes.len() * n);
        match planes.as_slice() {
            [a, b, c] if !rgb => {
                pixels.resize(3 * n, 0);
                ycc_to_rgb(a, b, c, &mut pixels);
            }
            planes => planes.iter().for_each(|p| pixels.extend_from_slice(p)),
        }
        Ok(Jpeg { width, height, channels: planes.len(), pixels })
    }
}

/// A baseline or extended sequential block (T.81 §F.2.2).
fn read_block(
    bits: &mut Bits,
    dc: Option<&Huffman>,
    ac: Option<&Huffman>,
    block: &mut [i16; 64],
    pred: &mut i32,
) -> Result<(), Fail> {
    let (dc, ac) = (dc.expect("checked at the scan"), ac.expect("checked at the scan"));
    *pred = pred.wrapping_add(dc_difference(bits, dc)?);
    block[0] = *pred as i16;
    let mut k = 1;
    while k < 64 {
        let rs = bits.decode(ac)?;
        let (run, size) = (usize::from(rs >> 4), u32::from(rs & 15));
        if size == 0 {
            if run != 15 {
                break;
            }
            k += 16;
        } else {
            k += run;
            block[NATURAL_ORDER[k.min(79)]] = bits.signed(size) as i16;
            k += 1;
        }
    }
    Ok(())
}

/// A progressive file's first DC scan (T.81 §G.1.2.1): the difference, scaled by `al` bits.
fn read_dc_first(
    bits: &mut Bits,
    dc: Option<&Huffman>,
    block: &mut [i16; 64],
    pred: &mut i32,
    al: u32,
) -> Result<(), Fail> {
    *pred = pred.wrapping_add(dc_difference(bits, dc.expect("checked at the scan"))?);
    block[0] = (*pred << al) as i16;
    Ok(())
}

/// A DC coefficient's difference from the previous block's (T.81 §F.2.2.1): its category
/// (libjpeg refuses one above 15), then that many bits.
fn dc_difference(bits: &mut Bits, dc: &Huffman) -> Result<i32, Fail> {
    let s = u32::from(bits.decode(dc)?);
    if s > 15 {
        return Err(format!("has a DC difference of {s} bits in its image data (at most 15); it is damaged"));
    }
    Ok(bits.signed(s))
}

/// A DC refinement scan: one more bit of each DC coefficient.
fn read_dc_refine(bits: &mut Bits, block: &mut [i16; 64], al: u32) {
    if bits.bit() {
        block[0] |= (1 << al) as i16;
    }
}

/// A first AC scan of the band `start..=end` (T.81 §G.1.2.2), with end-of-band runs.
fn read_ac_first(
    bits: &mut Bits,
    ac: Option<&Huffman>,
    block: &mut [i16; 64],
    scan: &Scan,
    eob_run: &mut u32,
) -> Result<(), Fail> {
    if *eob_run > 0 {
        *eob_run -= 1;
        return Ok(());
    }
    let ac = ac.expect("checked at the scan");
    let mut k = scan.start;
    while k <= scan.end {
        let rs = bits.decode(ac)?;
        let (run, size) = (u32::from(rs >> 4), u32::from(rs & 15));
        if size == 0 {
            if run < 15 {
                *eob_run = (1 << run) + bits.bits(run) - 1;
                break;
            }
            k += 16;
        } else {
            k += run as usize;
            block[NATURAL_ORDER[k.min(79)]] = (bits.signed(size) << scan.al) as i16;
            k += 1;
        }
    }
    Ok(())
}

/// An AC refinement scan (T.81 §G.1.2.3), as libjpeg's `decode_mcu_AC_refine` reads it: one
/// correction bit for each coefficient already nonzero, new coefficients of ±1 at bit `al`.
fn read_ac_refine(
    bits: &mut Bits,
    ac: Option<&Huffman>,
    block: &mut [i16; 64],
    scan: &Scan,
    eob_run: &mut u32,
) -> Result<(), Fail> {
    let (p1, m1) = (1i16 << scan.al, (-1i16) << scan.al);
    let refine = |bits: &mut Bits, coef: &mut i16| {
        if bits.bit() && (*coef & p1) == 0 {
            *coef = if *coef >= 0 { coef.wrapping_add(p1) } else { coef.wrapping_add(m1) };
        }
    };
    let mut k = scan.start;
    if *eob_run == 0 {
        let ac = ac.expect("checked at the scan");
        while k <= scan.end {
            let rs = bits.decode(ac)?;
            let (mut run, size) = (i32::from(rs >> 4), rs & 15);
            let mut value = 0;
            if size != 0 {
                if size != 1 {
                    return Err("has a refinement of more than one bit in its image data; it is damaged".into());
                }
                value = if bits.bit() { p1 } else { m1 };
            } else if run != 15 {
                *eob_run = (1 << run) + bits.bits(run as u32);
                break;
            }
            // Skip `run` zero coefficients, refining the nonzero ones passed on the way.
            while k <= scan.end {
                let coef = &mut block[NATURAL_ORDER[k]];
                if *coef != 0 {
                    refine(bits, coef);
                } else {
                    run -= 1;
                    if run < 0 {
                        break;
                    }
                }
                k += 1;
            }
            if value != 0 {
                block[NATURAL_ORDER[k.min(79)]] = value;
            }
            k += 1;
        }
    }
    if *eob_run > 0 {
        while k <= scan.end {
            let coef = &mut block[NATURAL_ORDER[k]];
            if *coef != 0 {
                refine(bits, coef);
            }
            k += 1;
        }
        *eob_run -= 1;
    }
    Ok(())
}

/// The islow IDCT's fixed point: 13-bit constants, 2 extra bits kept between the passes.
const CONST_BITS: u32 = 13;
const PASS1_BITS: u32 = 2;

/// libjpeg's `jpeg_idct_islow` (`jidctint.c`): the Loeffler–Ligtenberg–Moschytz inverse DCT in
/// 13-bit fixed point, columns then rows, 2 extra bits kept between the passes; dequantizes as
/// it reads and writes the 8 × 8 samples at `out` (rows `stride` apart) through [`range_limit`].
///
/// In 32-bit lanes, eight columns (then eight rows) at a time, like libjpeg-turbo's SIMD code;
/// a block whose values could overflow 32 bits goes through the 64-bit form,
/// [`idct_islow_wide`], which this equals on every block (tested, and to the bound:
/// [`LANE_BOUND`]).
fn idct_islow(block: &[i16], quant: &[u16; 64], out: &mut [u8], stride: usize) {
    let block: &[i16; 64] = block[..64].try_into().expect("a block is 64 coefficients");
    // (Compiled for the CPU's vector width: the baseline's has no 32-bit lane multiply.)
    let in_lanes = crate::ops::simd::vectorized(
        #[inline(always)]
        || {
            // The block's rows, each a vector of its eight columns: a pass over rows is eight
            // 1-D IDCTs down the columns at once. (Plain loops: an array's `map` and `from_fn`
            // are calls the features do not reach.)
            let mut x = [[0i32; 8]; 8];
            for (r, row) in x.iter_mut().enumerate() {
                for (c, v) in row.iter_mut().enumerate() {
                    *v = dequantized(block, quant, r * 8 + c);
                }
            }
            if !within_lane_bound(&x) {
                return false;
            }
            // Pass 1 down the columns: the workspace's rows.
            let ws = idct_pass_in_lanes(&x, CONST_BITS - PASS1_BITS);
            if !within_lane_bound(&ws) {
                return false;
            }
            // Pass 2 along the rows, the workspace's columns as vectors: the output's columns.
            let columns = idct_pass_in_lanes(&transposed(&ws), CONST_BITS + PASS1_BITS + 3);
            for (r, row) in transposed(&columns).iter().enumerate() {
                for (o, &v) in out[r * stride..r * stride + 8].iter_mut().zip(row) {
                    *o = range_limit(v);
                }
            }
            true
        },
    );
    if !in_lanes {
        idct_islow_wide(block, quant, out, stride);
    }
}

/// One islow pass in 32 bits on each of the 8 columns of `x` (its rows the pass's 8 inputs),
/// descaled by `bits`: a loop over the columns, which the compiler runs as vector lanes.
#[inline(always)]
fn idct_pass_in_lanes(x: &[[i32; 8]; 8], bits: u32) -> [[i32; 8]; 8] {
    let mut y = [[0; 8]; 8];
    for j in 0..8 {
        let out = idct_pass([x[0][j], x[1][j], x[2][j], x[3][j], x[4][j], x[5][j], x[6][j], x[7][j]]);
        for (y, v) in y.iter_mut().zip(out) {
            y[j] = v.descale(bits);
        }
    }
    y
}

/// The largest magnitude a pass's input may have in 32 bits: every value the pass forms on the
/// way (each a linear function of its inputs, so at its largest at some choice of signs, all of
/// which a test runs, every operation checked) then fits; twice it does not. A block past it
/// takes the 64-bit form: the same samples, slower.
const LANE_BOUND: u32 = 1 << 15;

#[inline(always)]
fn within_lane_bound(x: &[[i32; 8]; 8]) -> bool {
    x.iter().flatten().fold(0, |most, v| most.max(v.unsigned_abs())) <= LANE_BOUND
}

/// Row `i`, column `j` to row `j`, column `i`.
#[inline(always)]
fn transposed(m: &[[i32; 8]; 8]) -> [[i32; 8]; 8] {
    let mut t = [[0; 8]; 8];
    for (i, row) in m.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            t[j][i] = v;
        }
    }
    t
}

/// [`idct_islow`] in 64-bit arithmetic, a column or a row at a time with libjpeg's shortcut
/// for a column of only its DC term: its C code (whose shortcut for such a row gives the same
/// values as the full pass, and is left out). Any block, and the tests' reference for the lanes.
fn idct_islow_wide(block: &[i16], quant: &[u16; 64], out: &mut [u8], stride: usize) {
    let mut ws = [0i64; 64];
    for col in 0..8 {
        let x: [i64; 8] = std::array::from_fn(|r| i64::from(dequantized(block, quant, r * 8 + col)));
        let y = match x[1..].iter().all(|&v| v == 0) {
            // Only the DC term: the column is flat (libjpeg's shortcut; the same result).
            true => [x[0] << PASS1_BITS; 8],
            false => idct_pass(x).map(|v| v.descale(CONST_BITS - PASS1_BITS)),
        };
        for r in 0..8 {
            ws[r * 8 + col] = y[r];
        }
    }
    for row in 0..8 {
        let x: [i64; 8] = ws[row * 8..row * 8 + 8].try_into().expect("8 values");
        let y = idct_pass(x).map(|v| v.descale(CONST_BITS + PASS1_BITS + 3));
        for (c, v) in y.into_iter().enumerate() {
            out[row * stride + c] = range_limit(v as i32);
        }
    }
}

/// Coefficient `i` times its quantizer. libjpeg-turbo keeps quantizers as `short`
/// (`ISLOW_MULT_TYPE`): one of 32768 or more (a 16-bit table's) multiplies as a negative
/// number there, and so here. (Two 16-bit factors: the product fits 32 bits.)
#[inline(always)]
fn dequantized(block: &[i16], quant: &[u16; 64], i: usize) -> i32 {
    i32::from(block[i]) * i32::from(quant[i] as i16)
}

/// What one IDCT pass computes in: 64 bits (libjpeg's C code), or 32 (its SIMD code's lanes).
trait IdctValue: Copy + std::ops::Add<Output = Self> + std::ops::Sub<Output = Self> {
    fn times(self, k: i32) -> Self;
    fn shl(self, n: u32) -> Self;
    /// Rounded right shift by `n` (libjpeg's `DESCALE`).
    fn descale(self, n: u32) -> Self;
}

/// The same three operations at either width.
macro_rules! idct_value {
    ($($t:ty),*) => {$(
        impl IdctValue for $t {
            #[inline(always)]
            fn times(self, k: i32) -> Self {
                self * <$t>::from(k)
            }
            #[inline(always)]
            fn shl(self, n: u32) -> Self {
                self << n
            }
            #[inline(always)]
            fn descale(self, n: u32) -> Self {
                (self + (1 << (n - 1))) >> n
            }
        }
    )*};
}
idct_value!(i32, i64);

/// One 1-D islow pass on 8 inputs, before descaling: the even half (inputs 0, 2, 4, 6) and the
/// odd half (1, 3, 5, 7), combined into the 8 outputs.
#[inline(always)]
fn idct_pass<T: IdctValue>(x: [T; 8]) -> [T; 8] {
    let fix = |x| fixed(x, CONST_BITS);
    let z1 = (x[2] + x[6]).times(fix(0.541196100));
    let tmp2 = z1 + x[6].times(-fix(1.847759065));
    let tmp3 = z1 + x[2].times(fix(0.765366865));
    let tmp0 = (x[0] + x[4]).shl(CONST_BITS);
    let tmp1 = (x[0] - x[4]).shl(CONST_BITS);
    let (tmp10, tmp13, tmp11, tmp12) = (tmp0 + tmp3, tmp0 - tmp3, tmp1 + tmp2, tmp1 - tmp2);
    let (t0, t1, t2, t3) = (x[7], x[5], x[3], x[1]);
    let (z1, z2, z3, z4) = (t0 + t3, t1 + t2, t0 + t2, t1 + t3);
    let z5 = (z3 + z4).times(fix(1.175875602));
    let (t0, t1, t2, t3) = (
        t0.times(fix(0.298631336)),
        t1.times(fix(2.053119869)),
        t2.times(fix(3.072711026)),
        t3.times(fix(1.501321110)),
    );
    let (z1, z2) = (z1.times(-fix(0.899976223)), z2.times(-fix(2.562915447)));
    let (z3, z4) = (z3.times(-fix(1.961570560)) + z5, z4.times(-fix(0.390180644)) + z5);
    let (t0, t1, t2, t3) = (t0 + z1 + z3, t1 + z2 + z4, t2 + z2 + z3, t3 + z1 + z4);
    [tmp10 + t3, tmp11 + t2, tmp12 + t1, tmp13 + t0, tmp13 - t0, tmp12 - t1, tmp11 - t2, tmp10 - t3]
}

/// `x` in fixed point of `bits` fractional bits, rounded as libjpeg's `FIX` rounds it.
#[inline(always)]
const fn fixed(x: f64, bits: u32) -> i32 {
    (x * (1 << bits) as f64 + 0.5) as i32
}

/// libjpeg's post-IDCT range limit (`prepare_range_limit_table`): the sample level-shifted by
/// 128 and clamped to 0..=255, indexed by its low 10 bits, so values far out of range wrap as
/// they do in its C code (only a damaged or contrived file gets them; its SIMD code saturates).
/// Written without branches, so that it runs in vector lanes: `v` wrapped into -512..=511 by
/// its low 10 bits, then shifted and clamped (the table's four zones, tested).
#[inline(always)]
fn range_limit(v: i32) -> u8 {
    ((v.wrapping_add(512) & 1023) - 384).clamp(0, 255) as u8
}

/// A component's plane (`stride` samples a row) brought to the image's `width × height`:
/// `jdsample.c`'s choice of upsampler for the ratio `fh × fv`. The fancy (triangle) upsamplers
/// go a row at a time: the edges as libjpeg treats them, the interior in a loop without a
/// branch (the per-sample form, slower, is the tests' reference: `upsample_reference`).
fn upsample(plane: &[u8], stride: usize, c: &Component, fh: usize, fv: usize, width: usize, height: usize) -> Vec<u8> {
    // (Compiled for the CPU's vector width: the rows' loops run in its lanes.)
    crate::ops::simd::vectorized(
        #[inline(always)]
        || upsample_rows(plane, stride, c, fh, fv, width, height),
    )
}

/// [`upsample`]'s work, inlined into its copy for the CPU's vector width.
#[inline(always)]
fn upsample_rows(
    plane: &[u8],
    stride: usize,
    c: &Component,
    fh: usize,
    fv: usize,
    width: usize,
    height: usize,
) -> Vec<u8> {
    let (cw, ch) = (c.width, c.height);
    let row_of = |y: usize| &plane[y * stride..y * stride + cw];
    // The rows above the first and below the last are copies of them (libjpeg's context rows).
    let (above, below) = (|y: usize| y.saturating_sub(1), |y: usize| (y + 1).min(ch - 1));
    let mut out = vec![0u8; width * height];
    // Per output row of the vertical cases: 3 × the nearer chroma row + the farther one.
    let mut sums = vec![0i32; cw];
    for (y, row) in out.chunks_exact_mut(width).enumerate() {
        match (fh, fv) {
            (1, 1) => row.copy_from_slice(&row_of(y)[..width]),
            // Horizontally 3/4 of the nearer sample and 1/4 of the farther, rounding alternately
            // down and up (`h2v1_fancy_upsample`).
            (2, 1) if cw > 2 => {
                let src = row_of(y);
                let between = |a: u8, b: u8| {
                    let (a, b) = (i32::from(a), i32::from(b));
                    (((3 * a + b + 2) >> 2) as u8, ((3 * b + a + 1) >> 2) as u8)
                };
                two_across(row, src, src[0], between, src[cw - 1]);
            }
            // Vertically the same, the upper output row rounding down (`h1v2_fancy_upsample`).
            (1, 2) => {
                let (i, odd) = (y / 2, y % 2 == 1);
                let (far, bias) = if odd { (below(i), 2) } else { (above(i), 1) };
                let (near, far) = (row_of(i), row_of(far));
                for ((o, &n), &f) in row.iter_mut().zip(near).zip(far) {
                    *o = ((3 * i32::from(n) + i32::from(f) + bias) >> 2) as u8;
                }
            }
            // Both: 9/16, 3/16, 3/16, 1/16 of the four nearest (`h2v2_fancy_upsample`).
            (2, 2) if cw > 2 => {
                let (i, odd) = (y / 2, y % 2 == 1);
                let far = if odd { below(i) } else { above(i) };
                for ((s, &n), &f) in sums.iter_mut().zip(row_of(i)).zip(row_of(far)) {
                    *s = 3 * i32::from(n) + i32::from(f);
                }
                let between = |a: i32, b: i32| (((3 * a + b + 7) >> 4) as u8, ((3 * b + a + 8) >> 4) as u8);
                let (first, last) = (((4 * sums[0] + 8) >> 4) as u8, ((4 * sums[cw - 1] + 7) >> 4) as u8);
                two_across(row, &sums, first, between, last);
            }
            // Any other integer ratio, and 2:1 for chroma 2 samples wide or less: each sample
            // repeated (`int_upsample`, `h2v1_upsample`, `h2v2_upsample`).
            _ => {
                let src = row_of(y / fv);
                row.iter_mut().enumerate().for_each(|(x, o)| *o = src[x / fh]);
            }
        }
    }
    out
}

/// A row upsampled 2:1 across from `values` (more than 2) as the fancy upsamplers lay it out:
/// `first` at 0, the pair `between(values[j], values[j + 1])` at 2j+1 and 2j+2 (right of
/// sample j, left of sample j+1), and `last` at 2·`values.len()`−1 where the row reaches it (an odd image
/// width stops one short).
#[inline(always)]
fn two_across<T: Copy>(row: &mut [u8], values: &[T], first: u8, between: impl Fn(T, T) -> (u8, u8), last: u8) {
    row[0] = first;
    for (pair, v) in row[1..].chunks_exact_mut(2).zip(values.windows(2)) {
        (pair[0], pair[1]) = between(v[0], v[1]);
    }
    if let Some(end) = row.get_mut(2 * values.len() - 1) {
        *end = last;
    }
}

/// libjpeg's YCbCr → RGB (`jdcolor.c`, `ycc_rgb_convert`): 16-bit fixed-point products of the
/// chroma offsets, rounded as its tables round them, clamped to 0..=255. `out` is `[3, H, W]`.
/// Each table entry's formula computed in place of the lookup, in vector lanes (the same
/// values: every (Y, Cb, Cr) tested against the tables).
fn ycc_to_rgb(y: &[u8], cb: &[u8], cr: &[u8], out: &mut [u8]) {
    let n = y.len();
    let (r, rest) = out.split_at_mut(n);
    let (g, b) = rest.split_at_mut(n);
    crate::ops::simd::vectorized(
        #[inline(always)]
        || {
            let clamp = |v: i32| v.clamp(0, 255) as u8;
            let pixels = r.iter_mut().zip(g.iter_mut()).zip(b.iter_mut()).zip(y.iter().zip(cb).zip(cr));
            for (((r, g), b), ((&yy, &cb), &cr)) in pixels {
                let (yy, [r_of, g_of, b_of]) = (i32::from(yy), ycc_offsets(cb, cr));
                (*r, *g, *b) = (clamp(yy + r_of), clamp(yy + g_of), clamp(yy + b_of));
            }
        },
    );
}

/// What Cb and Cr add to Y for R, G and B: `jdcolor.c`'s table entries (`Cr_r_tab`,
/// `Cb_b_tab`, and `Cb_g_tab` + `Cr_g_tab` shifted), each formula as it builds them.
#[inline(always)]
fn ycc_offsets(cb: u8, cr: u8) -> [i32; 3] {
    const SCALEBITS: u32 = 16;
    const HALF: i32 = 1 << (SCALEBITS - 1);
    let fix = |x| fixed(x, SCALEBITS);
    let (cb, cr) = (i32::from(cb) - 128, i32::from(cr) - 128);
    [
        (fix(1.40200) * cr + HALF) >> SCALEBITS,
        (-fix(0.34414) * cb + HALF - fix(0.71414) * cr) >> SCALEBITS,
        (fix(1.77200) * cb + HALF) >> SCALEBITS,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`upsample`] sample by sample, each output its formula in `jdsample.c`: the reference the
    /// row-at-a-time form is held to.
    fn upsample_reference(
        plane: &[u8],
        stride: usize,
        c: &Component,
        fh: usize,
        fv: usize,
        width: usize,
        height: usize,
    ) -> Vec<u8> {
        let (cw, ch) = (c.width, c.height);
        let at = |x: usize, y: usize| i32::from(plane[y * stride + x]);
        // The rows above the first and below the last are copies of them (libjpeg's context rows).
        let (above, below) = (|y: usize| y.saturating_sub(1), |y: usize| (y + 1).min(ch - 1));
        let mut out = vec![0u8; width * height];
        for y in 0..height {
            let row = &mut out[y * width..(y + 1) * width];
            match (fh, fv) {
                (1, 1) => row.iter_mut().enumerate().for_each(|(x, o)| *o = at(x, y) as u8),
                // Horizontally 3/4 of the nearer sample and 1/4 of the farther, rounding alternately
                // down and up (`h2v1_fancy_upsample`).
                (2, 1) if cw > 2 => {
                    for (x, o) in row.iter_mut().enumerate() {
                        let (i, odd) = (x / 2, x % 2 == 1);
                        *o = match (i, odd) {
                            (0, false) => at(0, y),
                            (i, false) => (3 * at(i, y) + at(i - 1, y) + 1) >> 2,
                            (i, true) if i == cw - 1 => at(i, y),
                            (i, true) => (3 * at(i, y) + at(i + 1, y) + 2) >> 2,
                        } as u8;
                    }
                }
                // Vertically the same, the upper output row rounding down (`h1v2_fancy_upsample`).
                (1, 2) => {
                    let (i, odd) = (y / 2, y % 2 == 1);
                    let (far, bias) = if odd { (below(i), 2) } else { (above(i), 1) };
                    row.iter_mut().enumerate().for_each(|(x, o)| *o = ((3 * at(x, i) + at(x, far) + bias) >> 2) as u8);
                }
                // Both: 9/16, 3/16, 3/16, 1/16 of the four nearest (`h2v2_fancy_upsample`).
                (2, 2) if cw > 2 => {
                    let (i, odd) = (y / 2, y % 2 == 1);
                    let far = if odd { below(i) } else { above(i) };
                    let sum = |x: usize| 3 * at(x, i) + at(x, far);
                    for (x, o) in row.iter_mut().enumerate() {
                        let (j, right) = (x / 2, x % 2 == 1);
                        *o = match (j, right) {
                            (0, false) => (4 * sum(0) + 8) >> 4,
                            (j, false) => (3 * sum(j) + sum(j - 1) + 8) >> 4,
                            (j, true) if j == cw - 1 => (4 * sum(j) + 7) >> 4,
                            (j, true) => (3 * sum(j) + sum(j + 1) + 7) >> 4,
                        } as u8;
                    }
                }
                // Any other integer ratio, and 2:1 for chroma 2 samples wide or less: each sample
                // repeated (`int_upsample`, `h2v1_upsample`, `h2v2_upsample`).
                _ => row.iter_mut().enumerate().for_each(|(x, o)| *o = at(x / fh, y / fv) as u8),
            }
        }
        out
    }
    use std::path::{Path, PathBuf};

    const MOST: u64 = 1 << 26;

    fn fixtures() -> Vec<PathBuf> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jpeg");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "jpg"))
            .collect();
        files.sort();
        files
    }

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jpeg").join(name)).unwrap()
    }

    fn decode(bytes: &[u8]) -> Result<Jpeg, Fail> {
        decode_jpeg(bytes, MOST)
    }

    /// Every fixture (tests/fixtures/make_jpeg_fixtures.py: baseline, progressive, restart
    /// intervals, each upsampler, RGB, gray, 16-bit quantization tables, written by cjpeg and
    /// by Pillow) decodes to exactly the pixels Pillow's libjpeg-turbo gives.
    #[test]
    fn jpegs_decode_to_the_pixels_pillow_decodes() {
        let files = fixtures();
        assert_eq!(files.len(), 44, "the fixtures make_jpeg_fixtures.py writes");
        for path in files {
            let jpeg = decode(&std::fs::read(&path).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let want = std::fs::read(path.with_extension("raw")).unwrap();
            let n = jpeg.width * jpeg.height;
            // Pillow's rows of interleaved samples, from our planes.
            let got: Vec<u8> =
                (0..n * jpeg.channels).map(|i| jpeg.pixels[(i % jpeg.channels) * n + i / jpeg.channels]).collect();
            let name = path.file_name().unwrap().to_string_lossy();
            let gray = name.contains("gray");
            assert_eq!(jpeg.channels, if gray { 1 } else { 3 }, "{name}");
            let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            assert!(
                got.len() == want.len() && wrong == 0,
                "{name}: {wrong} of {} samples differ from Pillow's",
                want.len()
            );
        }
    }

    /// The exact inverse DCT in floating point: the samples level-shifted, rounded and clamped,
    /// and before the shift.
    fn idct_exact(block: &[i16; 64], quant: &[u16; 64]) -> ([u8; 64], [f64; 64]) {
        let c = |u: usize| if u == 0 { std::f64::consts::FRAC_1_SQRT_2 } else { 1.0 };
        let basis = |x: usize, u: usize| ((2 * x + 1) as f64 * u as f64 * std::f64::consts::PI / 16.0).cos();
        let values: [f64; 64] = std::array::from_fn(|i| {
            let (y, x) = (i / 8, i % 8);
            let terms = (0..64).map(|k| (k / 8, k % 8));
            let sum: f64 = terms
                .map(|(v, u)| {
                    let f = f64::from(block[v * 8 + u]) * f64::from(quant[v * 8 + u]);
                    c(u) * c(v) * f * basis(x, u) * basis(y, v)
                })
                .sum();
            sum / 4.0
        });
        (values.map(|v| (v + 128.0).round().clamp(0.0, 255.0) as u8), values)
    }

    /// Row at a time, each upsampler gives what its per-sample formulas give: every ratio the
    /// decoder reaches, chroma 1 to 9 samples wide (the edges of the fancy ones included, and
    /// the 2-wide fallback), image widths down to what the chroma covers.
    #[test]
    fn upsampling_a_row_at_a_time_equals_the_reference() {
        let mut rng = crate::rng::Rng::new(12);
        for (fh, fv) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2), (1, 4), (3, 1)] {
            for cw in 1usize..10 {
                for ch in 1..5 {
                    for width in (cw - 1) * fh + 1..=cw * fh {
                        for height in (ch - 1) * fv + 1..=ch * fv {
                            let stride = cw.next_multiple_of(8);
                            let plane: Vec<u8> = (0..stride * ch).map(|_| rng.below(256) as u8).collect();
                            let c = Component {
                                id: 2,
                                h: 1,
                                v: 1,
                                table: 0,
                                quant: None,
                                width: cw,
                                height: ch,
                                blocks_wide: stride / 8,
                                blocks_high: ch.div_ceil(8),
                                coefs: Vec::new(),
                                coef_bits: [-1; 64],
                                dc_pred: 0,
                            };
                            assert_eq!(
                                upsample(&plane, stride, &c, fh, fv, width, height),
                                upsample_reference(&plane, stride, &c, fh, fv, width, height),
                                "{fh}×{fv}, chroma {cw}×{ch}, image {width}×{height}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `islow` against the transform it approximates: within one level on random blocks (its
    /// 13-bit constants), exact on a flat one.
    #[test]
    fn the_integer_idct_is_within_a_level_of_the_exact_transform() {
        let mut rng = crate::rng::Rng::new(5);
        let (mut worst, mut compared) = (0, 0);
        for trial in 0..600 {
            let quant: [u16; 64] = std::array::from_fn(|_| 1 + rng.below(16) as u16);
            // Fewer coefficients in later trials, as quantization leaves them.
            let keep = 1 + trial % 64;
            let block: [i16; 64] =
                std::array::from_fn(|i| if NATURAL_ORDER[..keep].contains(&i) { rng.below(13) as i16 - 6 } else { 0 });
            let (exact, shifted) = idct_exact(&block, &quant);
            // Past the range limit's clamping zone libjpeg wraps (as a damaged file would).
            if shifted.iter().any(|v| !(-384.0..=383.0).contains(v)) {
                continue;
            }
            let mut out = [0u8; 64];
            idct_islow(&block, &quant, &mut out, 8);
            worst =
                worst.max(out.iter().zip(&exact).map(|(a, b)| (i32::from(*a) - i32::from(*b)).abs()).max().unwrap());
            compared += 1;
        }
        assert!(compared >= 400, "{compared} blocks compared");
        assert!(worst <= 1, "islow is {worst} levels from the exact IDCT");
        let mut flat = [0i16; 64];
        flat[0] = -5;
        let mut out = [0u8; 64];
        idct_islow(&flat, &[16; 64], &mut out, 8);
        assert_eq!(out, [118; 64], "DC -5 × 16 / 8 + 128");
    }

    /// Wraps as libjpeg's table does: the level shift within range, clamps beyond it.
    #[test]
    fn the_range_limit_shifts_and_clamps_as_libjpegs_table() {
        let got: Vec<u8> = [-129, -128, -1, 0, 127, 128, 511, 512].map(range_limit).to_vec();
        assert_eq!(got, [0, 0, 127, 128, 255, 255, 255, 0]);
        // The table's zones, as libjpeg builds it, on every low 10 bits and at the extremes.
        let table = |v: i32| match v & 1023 {
            x @ 0..=127 => (x + 128) as u8,
            128..=511 => 255,
            512..=895 => 0,
            x => (x - 896) as u8,
        };
        for v in (-3000..3000).chain([i32::MIN, i32::MIN + 1, i32::MAX - 1, i32::MAX]) {
            assert_eq!(range_limit(v), table(v), "{v}");
        }
    }

    /// The colour conversion equals `jdcolor.c`'s tables (built as `build_ycc_rgb_table` builds
    /// them, in 64 bits) on every (Y, Cb, Cr).
    #[test]
    fn ycc_to_rgb_equals_libjpegs_tables_everywhere() {
        const SCALEBITS: u32 = 16;
        const HALF: i64 = 1 << (SCALEBITS - 1);
        let fix = |x: f64| (x * (1 << SCALEBITS) as f64 + 0.5) as i64;
        let table = |f: &dyn Fn(i64) -> i64| -> Vec<i64> { (0..256).map(|i| f(i - 128)).collect() };
        let cr_r = table(&|x| (fix(1.40200) * x + HALF) >> SCALEBITS);
        let cb_b = table(&|x| (fix(1.77200) * x + HALF) >> SCALEBITS);
        let cr_g = table(&|x| -fix(0.71414) * x);
        let cb_g = table(&|x| -fix(0.34414) * x + HALF);
        let clamp = |v: i64| v.clamp(0, 255) as u8;
        // Per Cb: every Cr and Y.
        let (cr, y): (Vec<u8>, Vec<u8>) = (0..=255u8).flat_map(|cr| (0..=255u8).map(move |y| (cr, y))).unzip();
        let n = y.len();
        for cb in 0..=255u8 {
            let mut got = vec![0u8; 3 * n];
            ycc_to_rgb(&y, &vec![cb; n], &cr, &mut got);
            for i in 0..n {
                let (yy, cb, cr) = (i64::from(y[i]), cb as usize, cr[i] as usize);
                let want =
                    [clamp(yy + cr_r[cr]), clamp(yy + ((cb_g[cb] + cr_g[cr]) >> SCALEBITS)), clamp(yy + cb_b[cb])];
                assert_eq!([got[i], got[n + i], got[2 * n + i]], want, "Y {yy} Cb {cb} Cr {cr}");
            }
        }
    }

    /// The IDCT in 32-bit lanes equals its 64-bit form, libjpeg's C code, on every block: small
    /// coefficients and quantizers (1–15), coefficients as large as 12-bit samples give, and any
    /// 16-bit coefficients and quantizers (which the 64-bit form takes), at row strides wider
    /// than a block.
    #[test]
    fn the_idct_in_lanes_equals_the_64_bit_form() {
        let mut rng = crate::rng::Rng::new(9);
        for trial in 0..3000 {
            let (coef, quant_max) = match trial % 3 {
                0 => (64, 16),
                1 => (2048, 255),
                _ => (32768, 65536),
            };
            let quant: [u16; 64] = std::array::from_fn(|_| 1 + rng.below(quant_max - 1) as u16);
            let keep = 1 + trial % 64;
            let block: [i16; 64] = std::array::from_fn(|i| match NATURAL_ORDER[..keep].contains(&i) {
                true => (rng.below(2 * coef) as i64 - coef as i64) as i16,
                false => 0,
            });
            let stride = 8 + trial % 3;
            let (mut lanes, mut wide) = (vec![7u8; 8 * stride], vec![7u8; 8 * stride]);
            idct_islow(&block, &quant, &mut lanes, stride);
            idct_islow_wide(&block, &quant, &mut wide, stride);
            assert_eq!(lanes, wide, "trial {trial}");
        }
        // Where the lanes hand over: a DC of ±2¹⁵ (at the bound) and of ±(2¹⁵ + 1) (past it); and
        // the first row at ±2¹⁴ in every choice of signs, whose workspace, ±2¹⁶ in every row,
        // would overflow a second pass in 32 bits: the check on the workspace stops it. (The
        // test build's overflow checks see a pass run anyway. Without them the samples would
        // still agree: an overflow wraps by 2³², which moves a value shifted 18 bits right by a
        // multiple of 2¹⁴, and the range limit reads its low 10 bits.)
        let mut blocks: Vec<([i16; 64], [u16; 64])> = [(-32768, 65535), (-32768, 1), (10923, 3), (-10923, 3)]
            .into_iter()
            .map(|(dc, q)| (std::array::from_fn(|i| if i == 0 { dc } else { 0 }), [q; 64]))
            .collect();
        for signs in 0..256 {
            let row = |i: usize| if signs >> i & 1 == 1 { -16384 } else { 16384 };
            blocks.push((std::array::from_fn(|i| if i < 8 { row(i) } else { 0 }), [1; 64]));
        }
        for (block, quant) in &blocks {
            let (mut lanes, mut wide) = ([0u8; 64], [0u8; 64]);
            idct_islow(block, quant, &mut lanes, 8);
            idct_islow_wide(block, quant, &mut wide, 8);
            assert_eq!(lanes, wide, "DC {} × {}", block[0], quant[0] as i16);
        }
    }

    /// A 32-bit value whose every operation fails on overflow, whatever the build's checks.
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Checked(i32);

    impl std::ops::Add for Checked {
        type Output = Checked;
        fn add(self, other: Checked) -> Checked {
            Checked(self.0.checked_add(other.0).expect("a sum overflows 32 bits"))
        }
    }

    impl std::ops::Sub for Checked {
        type Output = Checked;
        fn sub(self, other: Checked) -> Checked {
            Checked(self.0.checked_sub(other.0).expect("a difference overflows 32 bits"))
        }
    }

    impl IdctValue for Checked {
        fn times(self, k: i32) -> Self {
            Checked(self.0.checked_mul(k).expect("a product overflows 32 bits"))
        }
        fn shl(self, n: u32) -> Self {
            self.times(1 << n)
        }
        fn descale(self, n: u32) -> Self {
            Checked((self + Checked(1 << (n - 1))).0 >> n)
        }
    }

    /// Within [`LANE_BOUND`] no value a pass forms overflows 32 bits: each is a linear function
    /// of the 8 inputs (the descale's rounding added), so at its largest magnitude where every
    /// input is ±the bound; all 256 such inputs run here, every operation checked, and equal the
    /// 64-bit pass. (Twice the bound overflows: the bound is not far from the most it could be.)
    #[test]
    fn a_pass_in_32_bits_cannot_overflow_within_its_bound() {
        let at = |bound: i32, signs: usize| -> [i32; 8] {
            std::array::from_fn(|k| if signs >> k & 1 == 1 { -bound } else { bound })
        };
        let bits = [CONST_BITS - PASS1_BITS, CONST_BITS + PASS1_BITS + 3];
        for (signs, bits) in (0..256).flat_map(|s| bits.map(|b| (s, b))) {
            let x = at(LANE_BOUND as i32, signs);
            let narrow = idct_pass(x.map(Checked)).map(|v| i64::from(v.descale(bits).0));
            let wide = idct_pass(x.map(i64::from)).map(|v| v.descale(bits));
            assert_eq!(narrow, wide, "signs {signs:08b}");
        }
        let twice = std::panic::catch_unwind(|| {
            (0..256).for_each(|signs| _ = idct_pass(at(2 * LANE_BOUND as i32, signs).map(Checked)))
        });
        assert!(twice.is_err(), "twice the bound fits too");
    }

    /// The first segment of `bytes` with marker `code`: where its marker starts.
    fn segment(bytes: &[u8], code: u8) -> usize {
        (2..bytes.len()).find(|&i| bytes[i - 2..i] == [0xFF, code]).unwrap() - 2
    }

    /// Each damage named: what libjpeg would warn about and fill in is refused here, as Pillow
    /// refuses a truncated file.
    #[test]
    fn damaged_and_unsupported_jpegs_are_refused_by_what_is_wrong() {
        let good = fixture("cjpeg-17x9-h2v1-restart-3b.jpg");
        let refused = |bytes: &[u8], says: &str| {
            let e = decode(bytes).err().unwrap_or_else(|| panic!("decoded; expected `{says}`"));
            assert!(e.contains(says), "{e}");
        };
        let data = segment(&good, 0xDA);
        refused(&good[..good.len() - 4], "ends before its last block");
        refused(&good[..data + 3], "runs past the end of the file");
        // A restart marker removed (its two bytes dropped).
        let rst =
            data + (data..good.len()).position(|i| good[i] == 0xFF && (0xD0..=0xD7).contains(&good[i + 1])).unwrap();
        refused(&[&good[..rst], &good[rst + 2..]].concat(), "lacks a restart marker");
        // The frame header rewritten: 12-bit, arithmetic, lossless, CMYK, a huge size.
        let sof = segment(&good, 0xC0);
        let with = |at: usize, b: &[u8]| {
            let mut v = good.clone();
            v[at..at + b.len()].copy_from_slice(b);
            v
        };
        refused(&with(sof + 4, &[12]), "12-bit samples; only 8-bit");
        refused(&with(sof + 1, &[0xC9]), "arithmetic coding");
        refused(&with(sof + 1, &[0xC3]), "lossless or hierarchical");
        refused(&with(sof + 9, &[4]), "CMYK");
        refused(
            &with(sof + 5, &[0x20, 0x00, 0x20, 0x00]),
            "blocks in a scan (of a 8192×8192 image), more than its last",
        );
        let e = decode_jpeg(&with(sof + 5, &[0x20, 0x00, 0x20, 0x01]), MOST).err().unwrap();
        assert!(e.contains("is a 8193×8192 JPEG; expected at most 67108864 pixels"), "{e}");
        // Chroma sampled 3×1 against the luma's 2×1: a ratio that is no integer.
        refused(&with(sof + 14, &[0x31]), "fractional ratio");
        // A scan of a component the frame lacks; a file with no scan at all.
        refused(&with(data + 5, &[9]), "scan of component 9");
        refused(&[&good[..data], &[0xFF, 0xD9][..]].concat(), "has no image data");
        refused(&good[..2], "ends before its end-of-image marker");
    }

    /// A progressive file refining a component before its DC scan (scans reordered) and a
    /// colour file with one component never scanned.
    #[test]
    fn jpegs_missing_scans_are_refused() {
        let good = fixture("pillow-37x23-420-progressive.jpg");
        let scans: Vec<usize> = (2..good.len()).filter(|&i| good[i - 2..i] == [0xFF, 0xDA]).map(|i| i - 2).collect();
        // Drop the first scan (the DC of all three components): the next refines without it.
        refused_with(&[&good[..scans[0]], &good[scans[1]..]].concat(), "a scan out of T.81's progression");
        // A file of one scan per component, its last scan dropped.
        let separate = fixture("cjpeg-17x9-h2v2-scan-per-component.jpg");
        let last = (2..separate.len()).rev().find(|&i| separate[i - 2..i] == [0xFF, 0xDA]).unwrap() - 2;
        let one = [&separate[..last], &[0xFF, 0xD9][..]].concat();
        refused_with(&one, "no scan of component 3");
    }

    /// What libjpeg reads past with a warning, read past here too, to the same pixels: a
    /// sequential scan whose band bytes are zeros (libjpeg: "some baseline files out there"),
    /// a DNL marker, an Adobe marker after the first scan (the colour space is settled there).
    #[test]
    fn what_libjpeg_reads_past_is_read_past() {
        let good = fixture("pillow-37x23-420.jpg");
        let want = decode(&good).unwrap().pixels;
        let sos = segment(&good, 0xDA);
        let band = sos + 4 + 1 + 2 * 3;
        let mut zeros = good.clone();
        zeros[band..band + 3].copy_from_slice(&[0, 0, 0]);
        let end = good.len() - 2;
        let dnl = [&good[..end], &[0xFF, 0xDC, 0x00, 0x04, 0x00, 23][..], &good[end..]].concat();
        // Without its JFIF segment (which settles YCbCr first), an Adobe "no transform" after the scan.
        let app0 = 4 + u16::from_be_bytes([good[4], good[5]]) as usize;
        assert_eq!(good[2..4], [0xFF, 0xE0]);
        let adobe = [
            &good[..2],
            &good[app0..end],
            &[0xFF, 0xEE, 0, 14][..],
            b"Adobe\x00\x64\x00\x00\x00\x00\x00",
            &good[end..],
        ]
        .concat();
        for (what, bytes) in [("zero band", zeros), ("DNL", dnl), ("late Adobe", adobe)] {
            assert!(decode(&bytes).is_ok_and(|j| j.pixels == want), "{what}");
        }
    }

    /// A progressive file of its DC scan alone: libjpeg would smooth its blocks; refused.
    #[test]
    fn progressive_jpegs_libjpeg_would_smooth_are_refused() {
        let good = fixture("pillow-37x23-420-progressive.jpg");
        let scans: Vec<usize> = (2..good.len()).filter(|&i| good[i - 2..i] == [0xFF, 0xDA]).map(|i| i - 2).collect();
        let dc_only = [&good[..scans[1]], &[0xFF, 0xD9][..]].concat();
        refused_with(&dc_only, "which libjpeg decodes with block smoothing");
    }

    fn refused_with(bytes: &[u8], says: &str) {
        let e = decode(bytes).err().unwrap_or_else(|| panic!("decoded; expected `{says}`"));
        assert!(e.contains(says), "{e}");
    }
}
