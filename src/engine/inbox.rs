//! The engine thread's inbox: a queue that callers push to, and an eventfd
//! that wakes the engine only while it sleeps. The engine waits on the
//! eventfd together with its control sockets in one poll(2), so a request
//! from a caller and a frame from the coordinator wake the same thread.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// A multi-producer queue with one consumer that sleeps in poll(2).
pub struct Inbox<T> {
    queue: Mutex<(VecDeque<T>, bool)>,
    wake: OwnedFd,
    parked: AtomicBool,
}

impl<T> Inbox<T> {
    /// An empty, open inbox.
    pub fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd takes no pointers; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Inbox {
            queue: Mutex::new((VecDeque::new(), false)),
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            parked: AtomicBool::new(false),
        })
    }

    /// Queues `item`; false once the inbox is closed (the item is dropped).
    pub fn push(&self, item: T) -> bool {
        {
            let mut q = self.queue.lock().unwrap();
            if q.1 {
                return false;
            }
            q.0.push_back(item);
        }
        if self.parked.load(Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our own eventfd.
            unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        true
    }

    /// Everything queued so far, oldest first.
    pub fn take(&self) -> VecDeque<T> {
        std::mem::take(&mut self.queue.lock().unwrap().0)
    }

    /// True when something is queued.
    pub fn has_items(&self) -> bool {
        !self.queue.lock().unwrap().0.is_empty()
    }

    /// Refuses further pushes and drops what is queued.
    pub fn close(&self) {
        let mut q = self.queue.lock().unwrap();
        q.1 = true;
        q.0.clear();
    }

    /// Announces that the consumer is about to sleep on [`Inbox::fd`]; false
    /// (and not parked) when an item arrived meanwhile.
    pub fn park(&self) -> bool {
        self.parked.store(true, Ordering::SeqCst);
        if self.has_items() {
            self.parked.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Ends a sleep begun by [`Inbox::park`] and clears the wake-up.
    pub fn unpark(&self) {
        self.parked.store(false, Ordering::SeqCst);
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a valid u64; EAGAIN when not signalled.
        unsafe { libc::read(self.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// The descriptor that becomes readable when a push wakes a parked consumer.
    pub fn fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::Inbox;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn readable(fd: i32, ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, ms) == 1 }
    }

    #[test]
    fn a_push_wakes_a_parked_consumer_and_only_then() {
        let inbox = Arc::new(Inbox::new().unwrap());
        inbox.push(1);
        assert!(!readable(inbox.fd(), 0), "not parked: no wake-up needed");
        assert!(!inbox.park(), "an item is queued: do not sleep");
        assert_eq!(inbox.take().into_iter().collect::<Vec<_>>(), vec![1]);
        assert!(inbox.park());
        let other = inbox.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            other.push(2)
        });
        let start = Instant::now();
        assert!(readable(inbox.fd(), 5000));
        assert!(start.elapsed() < Duration::from_secs(4));
        inbox.unpark();
        assert!(!readable(inbox.fd(), 0), "unpark clears the wake-up");
        assert!(t.join().unwrap());
        assert_eq!(inbox.take().into_iter().collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn a_closed_inbox_refuses_items() {
        let inbox = Inbox::new().unwrap();
        inbox.push("a");
        inbox.close();
        assert!(!inbox.push("b"));
        assert!(inbox.take().is_empty());
    }
}
