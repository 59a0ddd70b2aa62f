use super::*;

#[test]
fn matches_the_published_fnv1a_values() {
    // The published values of 64-bit FNV-1a for "", "a" and "foobar".
    assert_eq!(fnv1a(OFFSET, b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a(OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a(OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn another_start_gives_another_hash() {
    assert_ne!(
        fnv1a(OFFSET, b"allreduce.x"),
        fnv1a(OFFSET.rotate_left(32), b"allreduce.x")
    );
    assert_ne!(fnv1a(OFFSET, b"ab"), fnv1a(OFFSET, b"ba"));
}
