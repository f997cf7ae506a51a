//! A tiny JSON object writer for `list -o json` and the control socket: flat objects of
//! strings and numbers. (serde_json would do it too; this avoids a dependency for ten lines.)

pub struct JsonObj {
    out: String,
}

impl Default for JsonObj {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonObj {
    pub fn new() -> JsonObj {
        JsonObj {
            out: String::from("{"),
        }
    }
    fn key(&mut self, k: &str) {
        if self.out.len() > 1 {
            self.out.push(',');
        }
        self.out.push_str(&quote(k));
        self.out.push(':');
    }
    pub fn str(&mut self, k: &str, v: &str) -> &mut Self {
        self.key(k);
        self.out.push_str(&quote(v));
        self
    }
    pub fn num(&mut self, k: &str, v: u64) -> &mut Self {
        self.key(k);
        self.out.push_str(&v.to_string());
        self
    }
    /// Insert already-encoded JSON.
    pub fn raw(&mut self, k: &str, v: &str) -> &mut Self {
        self.key(k);
        self.out.push_str(v);
        self
    }
    pub fn finish(&mut self) -> String {
        let mut s = std::mem::take(&mut self.out);
        s.push('}');
        s
    }
}

/// A JSON string literal.
pub fn quote(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_flat_objects_and_escapes() {
        let mut o = JsonObj::new();
        o.str("a", "x\"y\\z\n").num("n", 42).raw("l", "[1,2]");
        assert_eq!(o.finish(), r#"{"a":"x\"y\\z\n","n":42,"l":[1,2]}"#);
        assert_eq!(quote("\u{1}"), "\"\\u0001\"");
    }
}
