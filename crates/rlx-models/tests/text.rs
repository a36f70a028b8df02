//! The text side of generation: the byte-level BPE tokenizer built from GGUF
//! metadata, chat-template rendering (and its sandbox), and streaming
//! detokenization. Most tests use a small hand-made vocabulary; the model-file
//! test checks the SmolLM2 reference ids.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rlx_models::bpe_vocab::{build_tokenizer, token_type, BpeVocabError, GgufVocab};
use rlx_models::chat_template::{ChatTemplate, ChatTemplateError, ChatTemplateLimits, Message};
use rlx_models::text_stream::{StreamStep, TextStream, TextStreamError};
use tokenizers::Tokenizer;

// ---------------------------------------------------------------------------
// A tiny byte-level vocabulary
// ---------------------------------------------------------------------------

/// GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the
/// rest are shifted to U+0100 and up, in byte order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return b as char;
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).unwrap()
}

/// The byte-level spelling of `s` (what the vocabulary stores).
fn bl(s: &str) -> String {
    s.bytes().map(byte_char).collect()
}

const CONTROL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const USER_DEFINED: &str = "<tool>";

/// 256 byte tokens, then merged tokens, then control tokens and one
/// user-defined token. Merges are given as pairs of plain strings.
fn tiny_vocab(pre: &str, merges: &[(&str, &str)]) -> GgufVocab {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut merge_lines = Vec::new();
    for (a, b) in merges {
        let merged = bl(&format!("{a}{b}"));
        if !tokens.contains(&merged) {
            tokens.push(merged);
        }
        merge_lines.push(format!("{} {}", bl(a), bl(b)));
    }
    let mut types = vec![token_type::NORMAL; tokens.len()];
    for c in CONTROL {
        tokens.push(c.to_string());
        types.push(token_type::CONTROL);
    }
    tokens.push(USER_DEFINED.to_string());
    types.push(token_type::USER_DEFINED);
    let id = |t: &str| tokens.iter().position(|x| x == t).map(|i| i as u32);
    GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        bos: id("<|im_start|>"),
        eos: id("<|im_end|>"),
        pad: id("<|im_end|>"),
        unk: id("<|endoftext|>"),
        tokens: tokens.clone(),
        merges: merge_lines,
        token_types: Some(types),
        add_bos: false,
        add_eos: false,
    }
}

const WORD_MERGES: &[(&str, &str)] = &[
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    (" ", "w"),
    ("o", "r"),
    (" w", "or"),
    (" wor", "l"),
    (" worl", "d"),
    (" ", " "),
    ("1", "2"),
    ("\n", "\n"),
];

fn tiny(pre: &str) -> Tokenizer {
    build_tokenizer(&tiny_vocab(pre, WORD_MERGES)).unwrap()
}

fn tokens(tok: &Tokenizer, text: &str) -> Vec<String> {
    tok.encode(text, false).unwrap().get_tokens().to_vec()
}

fn id_of(tok: &Tokenizer, token: &str) -> u32 {
    tok.token_to_id(token).unwrap_or_else(|| panic!("{token} not in vocabulary"))
}

// ---------------------------------------------------------------------------
// bpe_vocab
// ---------------------------------------------------------------------------

#[test]
fn encodes_and_decodes_words() {
    let tok = tiny("gpt2");
    assert_eq!(tokens(&tok, "hello world"), ["hello", "Ġworld"]);
    let ids = tok.encode("hello world", false).unwrap().get_ids().to_vec();
    assert_eq!(ids.len(), 2);
    assert_eq!(tok.decode(&ids, false).unwrap(), "hello world");
    // Bytes outside the merges fall back to single-byte tokens and round-trip.
    let text = "héllo\tworld 😀\r\n";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn control_tokens_match_inside_text_and_are_special() {
    let tok = tiny("gpt2");
    let text = "<|im_start|>user\nhello<|im_end|>";
    assert_eq!(tokens(&tok, text), ["<|im_start|>", "u", "s", "e", "r", "Ċ", "hello", "<|im_end|>"]);
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    assert_eq!(ids[0], id_of(&tok, "<|im_start|>"));
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhello");

    // llama.cpp's parse_special = false: control tokens are plain text,
    // user-defined ones still match.
    let mut literal = tiny("gpt2");
    literal.set_encode_special_tokens(true);
    let ids = literal.encode("<|im_start|><tool>", false).unwrap().get_ids().to_vec();
    assert!(!ids.contains(&id_of(&literal, "<|im_start|>")));
    assert_eq!(ids.last(), Some(&id_of(&literal, USER_DEFINED)));
    assert_eq!(literal.decode(&ids, false).unwrap(), "<|im_start|><tool>");
}

#[test]
fn user_defined_tokens_match_but_survive_skip_special() {
    let tok = tiny("gpt2");
    let ids = tok.encode("hello<tool>hello", false).unwrap().get_ids().to_vec();
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[1], id_of(&tok, USER_DEFINED));
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello<tool>hello");
}

#[test]
fn smollm_splits_every_digit_before_the_gpt2_expression() {
    let smollm = tiny("smollm");
    let gpt2 = tiny("gpt2");
    // llama.cpp's "smollm": digits are pieces of their own, so the spaces
    // before a digit stay one piece.
    assert_eq!(tokens(&smollm, "a  2"), ["a", "ĠĠ", "2"]);
    assert_eq!(tokens(&gpt2, "a  2"), ["a", "Ġ", "Ġ", "2"]);
    // The "1 2" merge never applies when digits are split first.
    assert_eq!(tokens(&smollm, "123"), ["1", "2", "3"]);
    assert_eq!(tokens(&gpt2, "123"), ["12", "3"]);
}

#[test]
fn llama3_and_qwen2_digit_grouping() {
    let llama3 = tiny("llama-bpe");
    let qwen2 = tiny("qwen2");
    let llama3_ids = llama3.encode("1234567", false).unwrap();
    // Groups of up to three digits; "12" is a token, so "123" -> "12", "3".
    assert_eq!(llama3_ids.get_tokens(), ["12", "3", "4", "5", "6", "7"]);
    let q = qwen2.encode("1234567", false).unwrap();
    assert_eq!(q.get_tokens(), ["1", "2", "3", "4", "5", "6", "7"]);
    // Contractions are their own pieces in both.
    assert_eq!(tokens(&llama3, "he'll"), ["he", "'", "ll"]);
    assert_eq!(tokens(&qwen2, "HE'LL"), ["H", "E", "'", "L", "L"]);
    // Newline runs are one piece (and "\n\n" is a merge).
    assert_eq!(tokens(&llama3, "a\n\nb"), ["a", "ĊĊ", "b"]);
}

#[test]
fn llama3_takes_whole_tokens_without_merges() {
    // "xyz" is in the vocabulary but no merge builds it: llama.cpp's Llama 3
    // tokenizer takes a piece that is a token as it is.
    let mut v = tiny_vocab("llama3", WORD_MERGES);
    v.tokens.push("xyz".into());
    v.token_types.as_mut().unwrap().push(token_type::NORMAL);
    let tok = build_tokenizer(&v).unwrap();
    assert_eq!(tokens(&tok, "xyz"), ["xyz"]);
    v.pre = Some("gpt2".into());
    let tok = build_tokenizer(&v).unwrap();
    assert_eq!(tokens(&tok, "xyz"), ["x", "y", "z"]);
}

#[test]
fn default_pre_splits_punctuation_first() {
    // GPT-2 keeps a space with the punctuation after it; llama.cpp's default
    // split isolates punctuation runs first.
    let mut v = tiny_vocab("default", &[(" ", ","), ("h", "e")]);
    let tok = build_tokenizer(&v).unwrap();
    assert_eq!(tokens(&tok, "he ,"), ["he", "Ġ", ","]);
    v.pre = None;
    let tok = build_tokenizer(&v).unwrap();
    assert_eq!(tokens(&tok, "he ,"), ["he", "Ġ", ","]);
    v.pre = Some("gpt2".into());
    let tok = build_tokenizer(&v).unwrap();
    assert_eq!(tokens(&tok, "he ,"), ["he", "Ġ,"]);
}

#[test]
fn bos_and_eos_only_when_asked() {
    let mut v = tiny_vocab("gpt2", WORD_MERGES);
    let (bos, eos) = (v.bos.unwrap(), v.eos.unwrap());
    let plain = build_tokenizer(&v).unwrap();
    assert_eq!(plain.encode("hello", true).unwrap().get_ids().len(), 1);
    v.add_bos = true;
    let tok = build_tokenizer(&v).unwrap();
    let ids = tok.encode("hello", true).unwrap().get_ids().to_vec();
    assert_eq!(ids.len(), 2);
    assert_eq!(ids[0], bos);
    assert_eq!(tok.encode("hello", false).unwrap().get_ids().len(), 1);
    v.add_eos = true;
    let tok = build_tokenizer(&v).unwrap();
    let ids = tok.encode("hello", true).unwrap().get_ids().to_vec();
    assert_eq!((ids.len(), ids[0], ids[2]), (3, bos, eos));
    v.add_bos = false;
    let tok = build_tokenizer(&v).unwrap();
    let ids = tok.encode("hello", true).unwrap().get_ids().to_vec();
    assert_eq!((ids.len(), ids[1]), (2, eos));
}

#[test]
fn bad_metadata_is_an_error() {
    let good = tiny_vocab("smollm", WORD_MERGES);
    build_tokenizer(&good).unwrap();
    let err = |f: &dyn Fn(&mut GgufVocab)| {
        let mut v = good.clone();
        f(&mut v);
        build_tokenizer(&v).unwrap_err()
    };

    let e = err(&|v| v.model = "llama".into());
    assert_eq!(e, BpeVocabError::UnsupportedModel("llama".into()));
    assert!(e.to_string().starts_with("unsupported tokenizer.ggml.model 'llama'"), "{e}");

    let e = err(&|v| v.pre = Some("xyz".into()));
    let msg = e.to_string();
    assert!(msg.starts_with("unsupported tokenizer.ggml.pre 'xyz' (supported: "), "{msg}");
    for name in ["default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2"] {
        assert!(msg.contains(name), "{msg}");
    }

    assert_eq!(err(&|v| v.tokens.clear()), BpeVocabError::EmptyVocab);
    assert!(matches!(err(&|v| v.tokens[260] = "h".into()), BpeVocabError::DuplicateToken { .. }));
    assert!(matches!(err(&|v| v.tokens[5] = String::new()), BpeVocabError::EmptyToken { id: 5 }));
    assert!(matches!(err(&|v| v.merges.push("hello".into())), BpeVocabError::MalformedMerge { .. }));
    assert!(matches!(err(&|v| v.merges.push("h ".into())), BpeVocabError::MalformedMerge { .. }));
    let e = err(&|v| v.merges.push("q ☃".into()));
    assert!(matches!(&e, BpeVocabError::MergeUnknownToken { token, .. } if token == "☃"), "{e}");
    // Both halves known, the merged token not.
    let e = err(&|v| v.merges.push("x y".into()));
    assert!(matches!(&e, BpeVocabError::MergeUnknownToken { token, .. } if token == "xy"), "{e}");
    let e = err(&|v| v.bos = Some(1_000_000));
    assert!(matches!(e, BpeVocabError::IdOutOfRange { which: "BOS", id: 1_000_000, .. }), "{e}");
    assert!(matches!(err(&|v| v.unk = Some(u32::MAX)), BpeVocabError::IdOutOfRange { .. }));
    let e = err(&|v| {
        v.token_types.as_mut().unwrap().pop();
    });
    assert!(matches!(e, BpeVocabError::TokenTypeCount { .. }), "{e}");
    assert!(matches!(err(&|v| v.token_types.as_mut().unwrap()[7] = 9), BpeVocabError::UnknownTokenType { id: 7, ty: 9 }));
    let e = err(&|v| {
        v.add_bos = true;
        v.bos = None;
    });
    assert_eq!(e, BpeVocabError::MissingSpecialId { which: "bos" });
}

// ---------------------------------------------------------------------------
// chat_template
// ---------------------------------------------------------------------------

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn msgs(pairs: &[(&str, &str)]) -> Vec<Message> {
    pairs.iter().map(|(r, c)| Message::new(*r, *c)).collect()
}

#[test]
fn renders_chatml() {
    let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
    let m = msgs(&[("system", "Be brief."), ("user", "Hi")]);
    assert_eq!(
        t.render(&m, true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.render(&m, false).unwrap(), "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    assert_eq!(t.render(&[], false).unwrap(), "");
}

#[test]
fn blocks_are_trimmed_like_transformers() {
    // trim_blocks and lstrip_blocks, as transformers renders chat templates.
    let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
    let t = ChatTemplate::new(src, "", "").unwrap();
    assert_eq!(t.render(&msgs(&[("user", "a"), ("bot", "b"), ("user", "c")]), false).unwrap(), "[a]\n[c]\n");
}

#[test]
fn special_token_variables_python_methods_and_raise_exception() {
    let src = "{{ bos_token }}{% for m in messages %}\
{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}\
{% if m.content.startswith('  ') %}<{{ m.content.strip() }}>{% else %}{{ m.content.upper() }}{% endif %}\
{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}";
    let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
    assert_eq!(t.render(&msgs(&[("user", "  hi  "), ("assistant", "yo")]), false).unwrap(), "<s><hi>YO</s>");
    match t.render(&msgs(&[("tool", "x")]), false) {
        Err(ChatTemplateError::Raised(m)) => assert_eq!(m, "bad role: tool"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn tojson_writes_what_python_json_dumps_writes() {
    let src =
        r#"{{ {"a": 1, "b": [1.5, true, none], "c": "é\"\n<"} | tojson }}|{{ [1, {"k": "v"}] | tojson(indent=2) }}|{{ [] | tojson }}"#;
    let t = ChatTemplate::new(src, "", "").unwrap();
    assert_eq!(
        t.render(&[], false).unwrap(),
        "{\"a\": 1, \"b\": [1.5, true, null], \"c\": \"é\\\"\\n<\"}|[\n  1,\n  {\n    \"k\": \"v\"\n  }\n]|[]"
    );
}

#[test]
fn template_errors_are_reported() {
    assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(ChatTemplateError::Syntax(_))));
    assert!(matches!(ChatTemplate::new("{{ x ", "", ""), Err(ChatTemplateError::Syntax(_))));
    let e = ChatTemplate::new("{{ messages | no_such_filter }}", "", "").and_then(|t| t.render(&[], false));
    assert!(matches!(e, Err(ChatTemplateError::Syntax(_) | ChatTemplateError::Render(_))), "{e:?}");
    let e = ChatTemplate::new("{% include 'other' %}", "", "").unwrap().render(&[], false);
    assert!(matches!(e, Err(ChatTemplateError::Render(_))), "{e:?}");
    let huge = "x".repeat(2 << 20);
    assert!(matches!(ChatTemplate::new(&huge, "", ""), Err(ChatTemplateError::SourceTooLarge { .. })));
}

/// Runs a hostile template and checks it fails, and fails fast.
fn hostile(src: &str) -> ChatTemplateError {
    let start = Instant::now();
    let result = ChatTemplate::new(src, "", "").and_then(|t| t.render(&msgs(&[("user", "hi")]), true));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(10), "{src}: took {took:?}");
    match result {
        Err(e) => e,
        Ok(out) => panic!("{src}: rendered {} bytes", out.len()),
    }
}

#[test]
fn sandbox_stops_endless_loops() {
    let e = hostile("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
    assert!(matches!(e, ChatTemplateError::OutOfFuel { .. }), "{e}");
}

#[test]
fn sandbox_caps_output() {
    let e = hostile("{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}");
    assert!(matches!(e, ChatTemplateError::OutputTooLarge { .. }), "{e}");
    let e = hostile("{{ 'x' * 90000000 }}");
    assert!(matches!(e, ChatTemplateError::OutputTooLarge { .. }), "{e}");
}

#[test]
fn sandbox_stops_deep_recursion() {
    let e = hostile("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    assert!(matches!(e, ChatTemplateError::Render(_)), "{e}");
    let e = hostile("{% macro f(n) %}{% for x in [1, 2] %}{{ f(n) }}{{ f(n) }}{% endfor %}{% endmacro %}{{ f(0) }}");
    assert!(matches!(e, ChatTemplateError::Render(_) | ChatTemplateError::OutOfFuel { .. }), "{e}");
    // The template including itself.
    let e = hostile("{% include 'chat_template' %}");
    assert!(matches!(e, ChatTemplateError::Render(_) | ChatTemplateError::OutOfFuel { .. }), "{e}");
}

#[test]
fn sandbox_survives_deeply_nested_values() {
    // A value nested about as deeply as the fuel allows (25 levels per
    // iteration, ~1 instruction per level), then printed, compared and
    // serialised: output or an error, never a stack overflow.
    let levels = |x: &str| format!("{}{x}{}", "[".repeat(25), "]".repeat(25));
    let iterations = ChatTemplateLimits::default().fuel / 35;
    for tail in ["{{ ns.x }}", "{{ ns.x == ns.y }}", "{{ ns.x | tojson }}", "{{ ns.x | length }}"] {
        let src = format!(
            "{{% set ns = namespace(x=[], y=[]) %}}{{% for i in range({iterations}) %}}{{% set ns.x = {} %}}{{% endfor %}}\
             {{% set ns.y = ns.x %}}{tail}",
            levels("ns.x")
        );
        let start = Instant::now();
        let result = ChatTemplate::new(&src, "", "").unwrap().render(&[], false);
        assert!(start.elapsed() < Duration::from_secs(10), "{tail}: took {:?}", start.elapsed());
        if tail.contains("tojson") {
            assert!(matches!(result, Err(ChatTemplateError::Render(_))), "{tail}: {result:?}");
        }
    }
    // Deep nesting in the source is refused by the parser.
    let src = format!("{{{{ {} }}}}", levels(&levels(&levels(&levels(&levels("1"))))));
    assert!(matches!(ChatTemplate::new(&src, "", ""), Err(ChatTemplateError::Syntax(_))));
}

// ---------------------------------------------------------------------------
// The SmolLM2 reference (tests/data/smollm2_reference.json)
// ---------------------------------------------------------------------------

fn reference() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn messages_of(item: &serde_json::Value) -> Vec<Message> {
    serde_json::from_value(item["messages"].clone()).unwrap()
}

#[test]
fn reference_chat_template_renders_the_reference_prompts() {
    let r = reference();
    let src = r["tokenization"]["chat_template"].as_str().unwrap();
    let t = ChatTemplate::new(src, "<|im_start|>", "<|im_end|>").unwrap();
    let mut chats = 0;
    for item in r["items"].as_array().unwrap() {
        if item["kind"] == "chat" {
            assert_eq!(t.render(&messages_of(item), true).unwrap(), item["prompt_text"].as_str().unwrap());
            chats += 1;
        }
    }
    assert!(chats > 0);
    // With a system message the default one is not injected.
    let m = msgs(&[("system", "S"), ("user", "U")]);
    assert_eq!(t.render(&m, false).unwrap(), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
}

// ---------------------------------------------------------------------------
// text_stream
// ---------------------------------------------------------------------------

/// Pushes every id and finishes; returns the pieces (the last one from
/// `finish`) and whether a stop string ended the stream.
fn stream_all(stream: &mut TextStream, ids: &[u32]) -> (Vec<String>, Option<String>) {
    let mut pieces = Vec::new();
    for &id in ids {
        match stream.push(id).unwrap() {
            StreamStep::Text(t) => pieces.push(t),
            StreamStep::Stopped { text, stop } => {
                pieces.push(text);
                return (pieces, Some(stop));
            }
        }
    }
    match stream.finish().unwrap() {
        StreamStep::Text(t) => {
            pieces.push(t);
            (pieces, None)
        }
        StreamStep::Stopped { text, stop } => {
            pieces.push(text);
            (pieces, Some(stop))
        }
    }
}

fn ids_of(tok: &Tokenizer, byte_level_tokens: &[&str]) -> Vec<u32> {
    byte_level_tokens.iter().map(|t| id_of(tok, t)).collect()
}

#[test]
fn stream_holds_a_character_split_across_tokens() {
    let tok = Arc::new(tiny("gpt2"));
    // "é" is C3 A9: two byte tokens. "😀" is four.
    let e = bl("é");
    let e_parts: Vec<String> = e.chars().map(String::from).collect();
    let mut ids = ids_of(&tok, &["hello"]);
    ids.extend(e_parts.iter().map(|t| id_of(&tok, t)));
    ids.extend(bl("😀").chars().map(|c| id_of(&tok, &c.to_string())));
    let mut s = TextStream::new(tok.clone(), false);
    let (pieces, stop) = stream_all(&mut s, &ids);
    assert_eq!(stop, None);
    assert_eq!(pieces, ["hello", "", "é", "", "", "", "😀", ""]);
}

#[test]
fn stream_passes_on_text_before_an_unfinished_character() {
    // One token holds "a" and the first byte of "é".
    let mut v = tiny_vocab("gpt2", WORD_MERGES);
    let a_lead = format!("a{}", bl("é").chars().next().unwrap());
    v.tokens.push(a_lead.clone());
    v.token_types.as_mut().unwrap().push(token_type::NORMAL);
    let tok = Arc::new(build_tokenizer(&v).unwrap());
    let tail = bl("é").chars().nth(1).unwrap().to_string();
    let ids = [id_of(&tok, &a_lead), id_of(&tok, &tail), id_of(&tok, "hello")];
    let (pieces, _) = stream_all(&mut TextStream::new(tok, false), &ids);
    assert_eq!(pieces, ["a", "é", "hello", ""]);
}

#[test]
fn stream_flushes_an_unfinished_character_at_the_end() {
    let tok = Arc::new(tiny("gpt2"));
    let lead = bl("é").chars().next().unwrap().to_string();
    let (pieces, _) = stream_all(&mut TextStream::new(tok.clone(), false), &ids_of(&tok, &["hello", &lead]));
    assert_eq!(pieces, ["hello", "", "\u{FFFD}"]);
}

#[test]
fn stream_skips_special_tokens_when_asked() {
    let tok = Arc::new(tiny("gpt2"));
    let ids = ids_of(&tok, &["hello", "<|im_end|>", "Ġworld"]);
    let (pieces, _) = stream_all(&mut TextStream::new(tok.clone(), true), &ids);
    assert_eq!(pieces.concat(), "hello world");
    let (pieces, _) = stream_all(&mut TextStream::new(tok.clone(), false), &ids);
    assert_eq!(pieces, ["hello", "<|im_end|>", " world", ""]);
}

#[test]
fn stream_stops_on_a_stop_string_spanning_tokens() {
    let tok = Arc::new(tiny("gpt2"));
    let ids = ids_of(&tok, &["hello", "Ġw", "or", "l"]);
    let mut s = TextStream::new(tok.clone(), false).with_stop_strings(["lo wo"]);
    assert_eq!(s.push(ids[0]).unwrap(), StreamStep::Text("hel".into()));
    assert_eq!(s.push(ids[1]).unwrap(), StreamStep::Text(String::new()));
    assert_eq!(s.push(ids[2]).unwrap(), StreamStep::Stopped { text: String::new(), stop: "lo wo".into() });
    assert_eq!(s.push(ids[3]), Err(TextStreamError::Ended));
    assert_eq!(s.finish().unwrap(), StreamStep::Text(String::new()));

    // The text before the stop string in the same step is passed on; what
    // follows it is not.
    let mut s = TextStream::new(tok.clone(), false).with_stop_strings(["l", "xyz"]);
    assert_eq!(s.push(ids[0]).unwrap(), StreamStep::Stopped { text: "he".into(), stop: "l".into() });

    // A stop string made of a special token's text.
    let ids = ids_of(&tok, &["hello", "<|im_end|>", "Ġworld"]);
    let (pieces, stop) = stream_all(&mut TextStream::new(tok.clone(), false).with_stop_strings(["<|im_end|>"]), &ids);
    assert_eq!((pieces.concat(), stop.as_deref()), ("hello".to_string(), Some("<|im_end|>")));
}

#[test]
fn stream_releases_a_held_prefix_that_is_not_a_stop_string() {
    let tok = Arc::new(tiny("gpt2"));
    let ids = ids_of(&tok, &["hello", "Ġw", "or", "l", "d"]);
    let mut s = TextStream::new(tok.clone(), false).with_stop_strings(["o wa", "ll!"]);
    assert_eq!(s.push(ids[0]).unwrap(), StreamStep::Text("hell".into()));
    assert_eq!(s.push(ids[1]).unwrap(), StreamStep::Text(String::new()));
    assert_eq!(s.push(ids[2]).unwrap(), StreamStep::Text("o wor".into()));
    // "l" may begin "ll!"; "ld" does not.
    assert_eq!(s.push(ids[3]).unwrap(), StreamStep::Text(String::new()));
    assert_eq!(s.push(ids[4]).unwrap(), StreamStep::Text("ld".into()));
    assert_eq!(s.finish().unwrap(), StreamStep::Text(String::new()));
}

#[test]
fn stream_finish_flushes_a_held_prefix() {
    let tok = Arc::new(tiny("gpt2"));
    let ids = ids_of(&tok, &["hello", "Ġw"]);
    let (pieces, stop) = stream_all(&mut TextStream::new(tok.clone(), false).with_stop_strings([" wx"]), &ids);
    assert_eq!(stop, None);
    assert_eq!(pieces, ["hello", "", " w"]);
}

#[test]
fn stream_cost_does_not_grow_with_length() {
    // Each step decodes only the open ids and the group before them: 50k
    // tokens take well under a second, where re-decoding everything would
    // take minutes.
    let tok = Arc::new(tiny("gpt2"));
    let ids = ids_of(&tok, &["hello", "Ġworld"]);
    let mut s = TextStream::new(tok, false).with_stop_strings(["never"]);
    let start = Instant::now();
    let mut len = 0;
    for i in 0..50_000 {
        len += s.push(ids[i % 2]).unwrap().text().len();
    }
    assert_eq!(len, 25_000 * "hello world".len());
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
}

#[test]
fn stream_rejects_unknown_ids() {
    let tok = Arc::new(tiny("gpt2"));
    let n = tok.get_vocab_size(true) as u32;
    let mut s = TextStream::new(tok, false);
    assert_eq!(s.push(n), Err(TextStreamError::UnknownId { id: n, vocab_size: n as usize }));
}

#[test]
fn stream_reassembles_any_text() {
    // Deterministic pseudo-random texts over ASCII, Latin, CJK and emoji,
    // encoded with the tiny vocabulary (so many characters are split into
    // byte tokens): the pieces always join to the text, with and without a
    // stop string that never matches.
    let tok = Arc::new(tiny("gpt2"));
    let alphabet: Vec<char> = "hello world 12 \n é ñ 你好 😀 ∑ ".chars().collect();
    let mut state = 0x2545_f491_u64;
    for round in 0..50 {
        let text: String = (0..40)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                alphabet[(state >> 33) as usize % alphabet.len()]
            })
            .collect();
        let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let (pieces, _) = stream_all(&mut TextStream::new(tok.clone(), false), &ids);
        assert_eq!(pieces.concat(), text, "round {round}");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "round {round}: {pieces:?}");
        let (pieces, stop) = stream_all(&mut TextStream::new(tok.clone(), false).with_stop_strings(["好好好好", "😀x"]), &ids);
        if stop.is_none() {
            assert_eq!(pieces.concat(), text, "round {round}");
        }
    }
}

#[test]
fn byte_level_stream_equals_decoding_all_ids_at_once() {
    // Random ids of the tiny vocabulary (lone bytes that are no character,
    // characters split across ids, merged tokens, control and user-defined
    // tokens): the pieces join to what the tokenizer's decode of all ids
    // gives, lossy bytes and skipped special tokens alike, and a piece never
    // ends inside a character that a later id completes.
    // Added tokens whose text is not all byte characters (a space, a CJK
    // character) stand for their own UTF-8, special or not.
    let mut t = tiny("gpt2");
    t.add_tokens([tokenizers::AddedToken::from("<end of turn>", false), tokenizers::AddedToken::from("Ā日", false)]).unwrap();
    t.add_special_tokens([tokenizers::AddedToken::from("<sp ecial>", true)]).unwrap();
    let tok = Arc::new(t);
    assert!(TextStream::new(tok.clone(), false).is_byte_level());
    let n = tok.get_vocab_size(true) as u64;
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    for round in 0..300 {
        let len = 1 + round % 37;
        let ids: Vec<u32> = (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % n) as u32
            })
            .collect();
        for skip in [false, true] {
            let (pieces, _) = stream_all(&mut TextStream::new(tok.clone(), skip), &ids);
            assert_eq!(pieces.concat(), tok.decode(&ids, skip).unwrap(), "round {round}, skip {skip}: {ids:?}");
        }
    }
    // A character in two ids is passed on whole, after the second.
    let lead = bl("é").chars().next().unwrap().to_string();
    let tail = bl("é").chars().nth(1).unwrap().to_string();
    let mut s = TextStream::new(tok.clone(), false);
    assert_eq!(s.push(id_of(&tok, &lead)).unwrap(), StreamStep::Text(String::new()));
    assert_eq!(s.push(id_of(&tok, &tail)).unwrap(), StreamStep::Text("é".into()));
}

// ---------------------------------------------------------------------------
// The real model file
// ---------------------------------------------------------------------------

fn gguf_path(test: &str) -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1", path.display());
    }
    eprintln!("SKIPPED {test}: {} is missing", path.display());
    None
}

/// The tokenizer metadata of a GGUF file as [`GgufVocab`].
fn gguf_vocab(f: &rlx_models::gguf::GgufFile) -> GgufVocab {
    let pre = f.get_opt_str("tokenizer.ggml.pre").unwrap().map(str::to_string);
    let add_bos =
        f.get_opt_bool("tokenizer.ggml.add_bos_token").unwrap().unwrap_or_else(|| rlx_models::bpe_vocab::default_add_bos(pre.as_deref()));
    GgufVocab {
        model: f.get_str("tokenizer.ggml.model").unwrap().to_string(),
        pre,
        tokens: f.get_str_array("tokenizer.ggml.tokens").unwrap().to_vec(),
        merges: f.get_str_array("tokenizer.ggml.merges").unwrap().to_vec(),
        token_types: f
            .contains_key("tokenizer.ggml.token_type")
            .then(|| f.get_i32_array("tokenizer.ggml.token_type").unwrap().into_owned()),
        bos: f.get_opt_u32("tokenizer.ggml.bos_token_id").unwrap(),
        eos: f.get_opt_u32("tokenizer.ggml.eos_token_id").unwrap(),
        pad: f.get_opt_u32("tokenizer.ggml.padding_token_id").unwrap(),
        unk: f.get_opt_u32("tokenizer.ggml.unknown_token_id").unwrap(),
        add_bos,
        add_eos: f.get_opt_bool("tokenizer.ggml.add_eos_token").unwrap().unwrap_or(false),
    }
}

#[test]
fn smollm2_gguf_tokenizes_like_the_reference() {
    let Some(path) = gguf_path("smollm2_gguf_tokenizes_like_the_reference") else {
        return;
    };
    let file = rlx_models::gguf::GgufFile::open(&path).unwrap();
    let vocab = gguf_vocab(&file);
    assert_eq!((vocab.pre.as_deref(), vocab.add_bos, vocab.add_eos), (Some("smollm"), false, false));
    let tok = Arc::new(build_tokenizer(&vocab).unwrap());
    let r = reference();
    for (text, id) in r["tokenization"]["special_ids"].as_object().unwrap() {
        assert_eq!(tok.token_to_id(text), Some(id.as_u64().unwrap() as u32));
    }
    let token_text = |id: Option<u32>| vocab.tokens[id.unwrap() as usize].clone();
    let source = file.get_str("tokenizer.chat_template").unwrap();
    assert_eq!(source, r["tokenization"]["chat_template"].as_str().unwrap());
    let template = ChatTemplate::new(source, &token_text(vocab.bos), &token_text(vocab.eos)).unwrap();

    let items = r["items"].as_array().unwrap();
    for item in items {
        let expected_text = item["prompt_text"].as_str().unwrap();
        let text = if item["kind"] == "chat" {
            template.render(&messages_of(item), true).unwrap()
        } else {
            item["prompt"].as_str().unwrap().to_string()
        };
        assert_eq!(text, expected_text);
        let ids = tok.encode(text.as_str(), true).unwrap().get_ids().to_vec();
        assert_eq!(ids, u32s(&item["input_ids"]), "{text:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), text);

        // The recorded generations, streamed.
        let g = &item["greedy"];
        let new_ids = u32s(&g["new_ids"]);
        let (pieces, _) = stream_all(&mut TextStream::new(tok.clone(), false), &new_ids);
        assert_eq!(pieces.concat(), g["text"].as_str().unwrap());
        let (pieces, _) = stream_all(&mut TextStream::new(tok.clone(), true), &new_ids);
        assert_eq!(pieces.concat(), g["text_skip_special"].as_str().unwrap());
        let full = g["text"].as_str().unwrap();
        if let Some(end) = full.find("<|im_end|>") {
            let mut s = TextStream::new(tok.clone(), false).with_stop_strings(["<|im_end|>"]);
            let (pieces, stop) = stream_all(&mut s, &new_ids);
            assert_eq!(stop.as_deref(), Some("<|im_end|>"));
            assert_eq!(pieces.concat(), &full[..end]);
        }
    }

    // llama.cpp's "smollm" split puts digits in pieces of their own.
    let t = |s: &str| tok.encode(s, false).unwrap().get_tokens().to_vec();
    assert_eq!(t("a  2"), ["a", "ĠĠ", "2"]);
    assert_eq!(t("Hello world! 123"), ["Hello", "Ġworld", "!", "Ġ", "1", "2", "3"]);
}
