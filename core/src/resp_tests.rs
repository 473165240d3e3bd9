use super::*;

#[test]
fn commands_are_arrays_of_bulk_strings() {
    let mut out = Vec::new();
    command(&mut out, &[&b"EVALSHA"[..], b"ab", b""]);
    assert_eq!(out, b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$0\r\n\r\n");
    let powers = (0..20).map(|k| 10u64.pow(k));
    let around = powers.flat_map(|p| [p - 1, p, p + 1, p.wrapping_mul(7).wrapping_add(3)]);
    for n in around.chain([42, 1234567890, 1_700_000_000_500, u64::MAX]) {
        let mut d = Vec::new();
        push_u64(&mut d, n);
        assert_eq!(d, n.to_string().as_bytes());
        let (mut b, mut want) = (b"x".to_vec(), b"x".to_vec());
        Writer::new(&mut b, 0).bulk_u64(n);
        bulk(&mut want, n.to_string().as_bytes());
        assert_eq!(b, want, "{n}");
        // heads as the appending functions write them
        let (mut b, mut want) = (b"x".to_vec(), b"x".to_vec());
        let mut w = Writer::new(&mut b, 0);
        w.array(n as usize);
        w.bulk_head(n as usize);
        array(&mut want, n as usize);
        bulk_head(&mut want, n as usize);
        assert_eq!(b, want, "{n}");
    }
}

#[test]
fn a_writer_writes_what_the_appending_functions_do_whatever_its_room() {
    for room in [0, 3, 64, 4096] {
        let (mut got, mut want) = (b"x".to_vec(), b"x".to_vec());
        {
            let mut w = Writer::new(&mut got, room);
            w.array(3);
            w.bulk_head(2);
            w.put(b"ab\r\n");
            w.bulk_u64(0);
            w.bulk_u64(u64::MAX);
            let from = w.mark();
            w.put(b"1234567");
            let to = w.mark();
            w.again(from, to);
        }
        array(&mut want, 3);
        bulk(&mut want, b"ab");
        bulk(&mut want, b"0");
        bulk(&mut want, u64::MAX.to_string().as_bytes());
        push_u64(&mut want, 1234567);
        push_u64(&mut want, 1234567);
        assert_eq!(got, want, "room {room}");
    }
}

#[test]
fn numbers_written_near_the_last_are_written_as_bulk_u64_writes_them() {
    let mut near = Near::default();
    let mut numbers = vec![0, 9, 9_999, 10_000, 10_001, 19_999, 20_000, 20_000, 99_999, u64::MAX];
    // deadlines a few ms apart, across a change of their high digits
    numbers.extend((0..50).map(|i| 1_764_329_999_990 + 3 * i));
    numbers.extend([1_764_330_000_100, 123_456, 1_764_330_000_101, u64::MAX - 1]);
    for n in numbers {
        let (mut got, mut want) = (Vec::new(), Vec::new());
        Writer::new(&mut got, 0).bulk_u64_near(n, &mut near);
        Writer::new(&mut want, 0).bulk_u64(n);
        assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want), "{n}");
    }
}

#[test]
fn integers_read_as_i64_from_str_reads_them() {
    let texts = [
        "0",
        "7",
        "-1",
        "-0",
        "42",
        "1234567890",
        "9223372036854775807",
        "-9223372036854775808",
        "9223372036854775808",
        "-9223372036854775809",
        "99999999999999999999",
        "",
        "-",
        "+1",
        "1a",
        " 1",
        "1 ",
        "--1",
        "0x10",
        "١",
    ];
    for t in texts {
        let want = t.parse::<i64>().ok().filter(|_| !t.starts_with('+'));
        assert_eq!(number(t.as_bytes()).ok(), want, "{t:?}");
    }
}

#[test]
fn every_reply_kind() {
    let all = b"+OK\r\n-NOSCRIPT No matching script\r\n:-12\r\n$3\r\na\r\n\r\n$-1\r\n*2\r\n:1\r\n*1\r\n:2\r\n*-1\r\n";
    let mut at = 0;
    let mut got = Vec::new();
    while let Some((v, n)) = parse(&all[at..]).unwrap() {
        got.push(v);
        at += n;
    }
    assert_eq!(at, all.len());
    assert_eq!(
        got,
        [
            Value::Status("OK".into()),
            Value::Error("NOSCRIPT No matching script".into()),
            Value::Int(-12),
            Value::Bulk(Some(b"a\r\n".to_vec())),
            Value::Bulk(None),
            Value::Array(Some(vec![Value::Int(1), Value::Array(Some(vec![Value::Int(2)]))])),
            Value::Array(None),
        ]
    );
    assert_eq!(got[1].error_code(), Some("NOSCRIPT"));
}

#[test]
fn a_partial_reply_waits_for_the_rest() {
    let whole = b"*3\r\n:7\r\n$2\r\nhi\r\n:0\r\n";
    for cut in 0..whole.len() {
        assert_eq!(parse(&whole[..cut]), Ok(None), "cut at {cut}");
    }
    let (v, n) = parse(whole).unwrap().unwrap();
    assert_eq!(n, whole.len());
    assert_eq!(
        v,
        Value::Array(Some(vec![Value::Int(7), Value::Bulk(Some(b"hi".to_vec())), Value::Int(0)]))
    );
}

/// A reply as a strict link reads it: an array of integers, or a `Value`.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Ints(Vec<i64>),
    Other(Value),
}

/// What a strict link reads of `bytes`: `read_ints`, and `parse` for what
/// it leaves to it.
fn parse_reply(bytes: &[u8]) -> Result<Option<(Reply, usize)>, ProtocolError> {
    // a vector that held something: it is cleared
    let mut ints = vec![5, 6];
    match read_ints(bytes, &mut ints)? {
        Ints::Read(n) => Ok(Some((Reply::Ints(ints), n))),
        Ints::Partial => Ok(None),
        Ints::Other => Ok(parse(bytes)?.map(|(v, n)| (Reply::Other(v), n))),
    }
}

/// What `parse_reply` reads of `bytes`, as `parse` reads it: an array
/// of integers as `Ints`, the rest as the same `Value`.
fn as_parse(bytes: &[u8]) -> Result<Option<(Reply, usize)>, ProtocolError> {
    parse(bytes).map(|o| {
        o.map(|(v, n)| match v {
            Value::Array(Some(ref items)) if items.iter().all(|i| matches!(i, Value::Int(_))) => {
                let ints = items.iter().map(|i| if let Value::Int(x) = i { *x } else { 0 });
                (Reply::Ints(ints.collect()), n)
            }
            v => (Reply::Other(v), n),
        })
    })
}

#[test]
fn replies_read_as_parse_reads_them_integer_arrays_as_integers() {
    let replies: [&[u8]; 21] = [
        b"*2\r\n:999999999999999999\r\n:1000000000000000000\r\n",
        b"*01\r\n:5\r\n",
        b"*65536\r\n",
        b"*9\r\n:1\r\n:2\r\n:3\r\n:4\r\n:5\r\n:6\r\n:7\r\n:8\r\n:9\r\n",
        b"*1\r\n:007\r\n",
        b"*1\r\n:7\rx\n",
        b"*1\r\n:7\n",
        b"*4\r\n:7\r\n:2\r\n:1\r\n:0\r\n",
        b"*0\r\n",
        b"*-1\r\n",
        b"*2\r\n:-9223372036854775808\r\n:9223372036854775807\r\n",
        b"*3\r\n:7\r\n$2\r\nhi\r\n:0\r\n",
        b"*2\r\n:1\r\n*1\r\n:2\r\n",
        b"-NOSCRIPT No matching script\r\n",
        b"+OK\r\n",
        b":5\r\n",
        b"*1\r\n:1a\r\n",
        b"*1\r\n:\r\n",
        b"*2\r\n:1\r\n?\r\n",
        b"*65537\r\n",
        b"*1\r\n:99999999999999999999\r\n",
    ];
    for r in replies {
        let mut two = r.to_vec();
        two.extend_from_slice(b":1\r\n");
        for bytes in [r, &two[..]] {
            let show = String::from_utf8_lossy(bytes);
            assert_eq!(parse_reply(bytes), as_parse(bytes), "{show:?}");
            for cut in 0..bytes.len() {
                let part = &bytes[..cut];
                let show = String::from_utf8_lossy(part);
                assert_eq!(parse_reply(part), as_parse(part), "{show:?}");
            }
        }
    }
    assert_eq!(
        parse_reply(b"*3\r\n:7\r\n:2\r\n:1\r\n"),
        Ok(Some((Reply::Ints(vec![7, 2, 1]), 16)))
    );
}

#[test]
fn hostile_streams_are_errors_not_allocations() {
    for bad in [
        &b"?x\r\n"[..],
        b"\r\n",
        b":12a\r\n",
        b"+OK\n",
        b"$5\r\nabcdeXY",
        b"$-2\r\n",
        b"*-5\r\n",
        b"$99999999999\r\n",
        b"*4294967296\r\n",
        b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
    ] {
        assert_eq!(parse(bad), Err(ProtocolError), "{:?}", String::from_utf8_lossy(bad));
    }
    // a huge array announced, little sent: no allocation of its size,
    // just a wait for more
    assert_eq!(parse(b"*65536\r\n:1\r\n"), Ok(None));
    // a line that never ends is bounded
    let mut long = b"+".to_vec();
    long.resize(MAX_LINE + 2, b'a');
    assert_eq!(parse(&long), Err(ProtocolError));
}

#[test]
fn digits_are_a_numbers_decimal_text_and_its_length() {
    for n in [0, 7, 9, 10, 99, 100, 9_999, 10_000, 1_764_280_800, 99_999_999_999, u64::MAX] {
        let d = Digits::of(n);
        assert_eq!(d.as_bytes(), n.to_string().as_bytes(), "{n}");
        assert_eq!(d.count(), n.to_string().len(), "{n}");
    }
}
