//! A heap byte buffer aligned for every element type the core handles.

/// A zero-initialised byte buffer whose start is 64-byte aligned.
#[derive(Default)]
pub struct AlignedBuf {
    words: Vec<Block>,
    len: usize,
}

/// One cache line; the unit of allocation.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Block([u8; 64]);

impl Default for Block {
    fn default() -> Self {
        Block([0; 64])
    }
}

impl AlignedBuf {
    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        AlignedBuf {
            words: vec![Block::default(); len.div_ceil(64)],
            len,
        }
    }

    /// A copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut b = Self::zeroed(bytes.len());
        b.as_mut_slice().copy_from_slice(bytes);
        b
    }

    /// Grows (never shrinks the allocation) and sets the length to `len`.
    pub fn resize(&mut self, len: usize) {
        let need = len.div_ceil(64);
        if need > self.words.len() {
            self.words.resize(need, Block::default());
        }
        self.len = len;
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes allocated: the most [`AlignedBuf::resize`] can reach without moving.
    pub fn capacity(&self) -> usize {
        self.words.len() * 64
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }

    /// Pointer to the first byte (stable until the next `resize`).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.words.as_mut_ptr().cast()
    }
}
