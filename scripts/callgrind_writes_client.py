"""N pools.create over C keep-alive connections, names prefixed so runs do not collide; prints
how many were answered 200 (any other answer stops it). The token is read from a file, never
taken as an argument."""
import http.client
import sys
import threading

port, token_file, n, conns, prefix = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
with open(token_file) as f:
    token = f.read().strip()
done = [0]
lock = threading.Lock()


def run(t):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for i in range(n // conns):
        body = '{"name":"%s%d-%d"}' % (prefix, t, i)
        c.request("POST", "/api/compute/pools.create", body=body,
                  headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        if r.status != 200:
            raise SystemExit("pools.create answered %d" % r.status)
        with lock:
            done[0] += 1


threads = [threading.Thread(target=run, args=(t,)) for t in range(conns)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(done[0])
