"""The system perl, for what is real Perl in a .t file: eval sections,
the preamble's side effects, block preprocessors, --- init code."""

import json
import subprocess
import tempfile
import threading

from tn_text import L1, show
from tn_regex import Regex


PERL_HELPER = r'''
BEGIN { $SIG{__WARN__} = sub { print STDERR "perl warning: ", @_ }; }
package Test::Base::Filter;
use strict; use warnings;
sub __runner_eval { return CORE::eval($_[0]); }

# A block as add_block_preprocessor's handlers get it, Test::Base's way: every
# section (and name, description) an array in the object's hash, read
# through an accessor of its name (the first value, or all of them in list
# context; nothing for a section the block lacks), written with set_value.
package Test::Base::Block;
use Carp ();
our $AUTOLOAD;
sub new { my ($class, %h) = @_; return bless {%h}, $class; }
sub seq_num { return $_[0]{seq_num}; }
sub set_value {
    my ($self, $name, @value) = @_;
    $self->{$name} = [@value];
}
sub AUTOLOAD {
    my $self = shift;
    (my $name = $AUTOLOAD) =~ s/.*:://;
    return if $name eq 'DESTROY';
    Carp::croak("Not allowed to set values for '$name'") if @_;
    my @list = @{ $self->{$name} || [] };
    return wantarray ? @list : $list[0];
}

package main;
use JSON::PP ();
binmode STDIN;
# the replies go to the real stdout; what the .t file's code prints, to stderr
open(my $__rn_reply, '>&', \*STDOUT) or die "dup stdout: $!";
open(STDOUT, '>&', \*STDERR) or die "stdout to stderr: $!";
binmode $__rn_reply;
$__rn_reply->autoflush(1);
my $__rn_json = JSON::PP->new->latin1->canonical->allow_nonref;

our @__rn_preprocessors;
sub add_block_preprocessor(&) { unshift @__rn_preprocessors, shift; }
{
    no strict 'refs';
    *{"Test::Nginx::${_}::add_block_preprocessor"} = \&add_block_preprocessor for qw(Socket Util);
}

sub __rn_conv {
    my ($v, $d) = @_;
    return undef unless defined $v;
    return { __unsupported__ => 'too deep' } if ($d || 0) > 50;
    my $r = ref $v;
    return "$v" unless $r;
    if ($r eq 'Regexp') {
        my ($p, $m) = re::regexp_pattern($v);
        return { __regex__ => $p, flags => $m };
    }
    return [ map { __rn_conv($_, ($d || 0) + 1) } @$v ] if $r eq 'ARRAY';
    return { __hash__ => { map { ($_ => __rn_conv($v->{$_}, ($d || 0) + 1)) } keys %$v } }
        if $r eq 'HASH';
    return __rn_conv($$v, ($d || 0) + 1) if $r eq 'SCALAR' || $r eq 'REF';
    return { __unsupported__ => $r eq 'Test::Nginx::Runner::Unsupported' ? $v->{what} : $r };
}

# the inverse: a value the runner holds, as Perl
sub __rn_from {
    my ($v) = @_;
    my $r = ref $v;
    return $v unless $r;
    return [ map { __rn_from($_) } @$v ] if $r eq 'ARRAY';
    if (exists $v->{__regex__}) {
        my $p = $v->{__regex__};
        (my $flags = $v->{flags} // '') =~ s/[^msixpn]//g;
        return eval "qr/\$p/$flags" || die "qr/$p/$flags: $@";
    }
    return { map { ($_ => __rn_from($v->{__hash__}{$_})) } keys %{ $v->{__hash__} } }
        if exists $v->{__hash__};
    return bless { what => $v->{__unsupported__} }, 'Test::Nginx::Runner::Unsupported';
}

sub __rn_env { return { map { ($_ => $ENV{$_}) } grep { /^TEST_NGINX_/ } keys %ENV }; }

# first request: stubs, the preamble, the eval sections
sub __rn_eval {
    my ($req) = @_;
    {
        no strict 'refs';
        my $vals = $req->{stub_values} || {};
        for my $f (@{ $req->{stubs} || [] }) {
            next if defined &{"main::$f"};
            my $v = $vals->{$f};
            *{"main::$f"} = sub { return defined $v ? $v : 1 };
        }
    }
    my $pre_err;
    if (defined $req->{preamble} && length $req->{preamble}) {
        local $@;
        my $ok = eval("package main; no strict; no warnings;\n#line 1 \"preamble\"\n"
                      . $req->{preamble} . "\n;1");
        $pre_err = "$@" unless $ok;
    }
    my @out;
    for my $code (@{ $req->{codes} || [] }) {
        local $@;
        my @r = Test::Base::Filter::__runner_eval($code);
        if ($@) {
            push @out, { ok => 0, error => "$@" };
        } else {
            push @out, { ok => 1, values => [ map { __rn_conv($_) } @r ] };
        }
    }
    return { results => \@out, env => __rn_env(), preamble_error => $pre_err,
             preprocessors => scalar @__rn_preprocessors };
}

# second request: every block through the preprocessors, as Test::Nginx does
# before running it; the reply holds the sections they set or removed
my %__rn_own = map { ($_ => 1) } qw(name description seq_num);
sub __rn_preprocess {
    my ($req) = @_;
    my @out;
    for my $in (@{ $req->{blocks} }) {
        my %h = (name => [$in->{name}], description => [$in->{name}], seq_num => $in->{seq});
        my $block;
        my %before;
        my $ok = eval {
            for my $s (keys %{ $in->{sections} }) {
                $h{$s} = __rn_from($in->{sections}{$s});
            }
            $block = Test::Base::Block->new(%h);
            %before = map { ($_ => $__rn_json->encode(__rn_conv($block->{$_}))) }
                      grep { !$__rn_own{$_} } keys %$block;
            $_->($block) for @__rn_preprocessors;
            1;
        };
        if (!$ok) {
            push @out, { error => "$@" };
            next;
        }
        my (%set, @removed);
        for my $s (keys %$block) {
            next if $__rn_own{$s} || $s =~ /^_/;
            my $v = $block->{$s};
            $v = [$v] unless ref $v eq 'ARRAY';
            my $now = __rn_conv($v);
            $set{$s} = $now if !exists $before{$s} || $before{$s} ne $__rn_json->encode($now);
        }
        @removed = grep { !exists $block->{$_} } sort keys %before;
        push @out, { set => \%set, removed => \@removed };
    }
    return { blocks => \@out, env => __rn_env() };
}

while (defined(my $line = <STDIN>)) {
    my $req = $__rn_json->decode($line);
    my $op = $req->{op} // '';
    my $reply = $op eq 'eval' ? __rn_eval($req)
              : $op eq 'preprocess' ? __rn_preprocess($req)
              : { error => "unknown request '$op'" };
    print $__rn_reply $__rn_json->encode($reply), "\n";
}
'''

PERL_INIT_HELPER = r'''
package Test::Nginx::Util;
use Time::HiRes qw(sleep time);
binmode STDIN;
my $__rn_code = do { local $/; <STDIN> };
my $__rn_ok = eval("use strict; use warnings;\n#line 1 \"init\"\n" . $__rn_code . "\n;1");
if (!$__rn_ok) { print STDERR "init failed: $@"; exit 1; }
exit 0;
'''

PREAMBLE_STUBS = [
    "master_on", "master_off", "workers", "worker_connections", "repeat_each",
    "no_shuffle", "use_hup", "no_long_string", "log_level", "no_root_location",
    "plan", "run_tests", "blocks", "env_to_nginx", "config_preamble",
    "master_process_enabled", "timeout", "server_name", "server_addr",
    "server_root", "html_dir", "server_port", "server_port_for_client",
    "no_nginx_manager", "check_accum_error_log", "bail_out",
    "add_test_cleanup_handler", "add_cleanup_handler", "add_response_body_check", "set_http_config_filter", "no_diff", "filters",
    "no_diag_on_only", "run_tests", "is_str", "sleep_time", "verbose",
]


def from_perl_json(v):
    if isinstance(v, dict):
        if "__regex__" in v:
            return Regex(v["__regex__"], v.get("flags") or "")
        if "__hash__" in v:
            return {k: from_perl_json(x) for k, x in v["__hash__"].items()}
        if "__unsupported__" in v:
            return Unsupported(v["__unsupported__"])
        return {k: from_perl_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_perl_json(x) for x in v]
    return v


class Unsupported:
    def __init__(self, what):
        self.what = what

    def __repr__(self):
        return "<unsupported Perl value %s>" % self.what


def to_perl_json(v):
    """A section's value as from_perl_json reads it (the helper's __rn_from
    turns it back into Perl: qr// for a Regex)."""
    if isinstance(v, Regex):
        return {"__regex__": v.pattern, "flags": v.flags}
    if isinstance(v, Unsupported):
        return {"__unsupported__": v.what}
    if isinstance(v, dict):
        return {"__hash__": {k: to_perl_json(x) for k, x in v.items()}}
    if isinstance(v, list):
        return [to_perl_json(x) for x in v]
    return v


class PerlError(Exception):
    """The Perl helper failed (died, timed out, answered nonsense)."""


class PerlSession:
    """PERL_HELPER running for one .t file: ask() sends one request (a JSON
    line) and returns its reply (a JSON line).  The process is ours and is
    killed (by its Popen) when the whole session takes over `timeout` s."""

    def __init__(self, env, timeout=120.0):
        self.timeout = timeout
        self.expired = False
        self.stderr = tempfile.TemporaryFile()
        self.error = None
        try:
            self.p = subprocess.Popen(["perl", "-e", PERL_HELPER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        except OSError as e:
            self.p = None
            self.error = "cannot run perl: %s" % e
            return
        self.timer = threading.Timer(timeout, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def _expire(self):
        self.expired = True
        try:
            self.p.kill()
        except OSError:
            pass

    def ask(self, req):
        if self.p is None:
            raise PerlError(self.error)
        try:
            self.p.stdin.write(json.dumps(req).encode("ascii") + b"\n")
            self.p.stdin.flush()
            line = self.p.stdout.readline()
        except OSError:
            line = b""
        if not line:
            raise PerlError(self.failure())
        try:
            return json.loads(line.decode(L1))
        except ValueError as e:
            raise PerlError("perl helper answered %s: %s" % (show(line.decode(L1), 200), e))

    def failure(self):
        if self.expired:
            return "perl helper timed out after %.0fs" % self.timeout
        try:
            rc = self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        return "perl helper failed (exit %s): %s" % (rc, self.stderr_text()[-2000:])

    def stderr_text(self):
        self.stderr.seek(0)
        return self.stderr.read().decode(L1)

    def close(self):
        """End the process (EOF on its stdin); returns its stderr."""
        if self.p is None:
            return ""
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.timer.cancel()
        self.p.stdout.close()
        text = self.stderr_text()
        self.stderr.close()
        return text
